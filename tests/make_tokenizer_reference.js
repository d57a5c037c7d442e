// Writes tests/reference/tokenizer-gpt2.jsonl: varied sentences (unicode, emoji, numbers,
// whitespace runs, contractions, newlines) and their GPT-2 token ids from the npm package
// gpt-3-encoder, the JavaScript port of OpenAI's encoder; and tokenizer-llama3.jsonl and
// tokenizer-llama2.jsonl: the ids of the first LLAMA_TEXTS of those sentences from the npm
// packages llama3-tokenizer-js and llama-tokenizer-js (no BOS/EOS). tests/test_data.c checks
// that litgpt.h's tokenizers give the same ids. Run from the repository root after
// `make tokenizers`:
//     node tests/make_tokenizer_reference.js data/npm/node_modules
// The sentences are generated here (seeded), so nothing third-party is committed.
const path = require('path');
const fs = require('fs');
const modules = path.resolve(process.argv[2] || 'data/npm/node_modules');
const { encode } = require(path.join(modules, 'gpt-3-encoder'));
const LLAMA_TEXTS = 800;

let state = 12345;
function random() { // xorshift32, seeded: the file is the same on every run
    state ^= state << 13; state >>>= 0;
    state ^= state >>> 17;
    state ^= state << 5; state >>>= 0;
    return state / 4294967296;
}
const pick = list => list[Math.floor(random() * list.length)];

const words = ['the', 'memory', 'of', 'a', 'model', 'is', 'Training', 'GPU', 'tokens', 'LitGPT',
    'fine-tuning', 'sequence', 'length', 'batch', 'and', 'with', 'out', 'I', 'you', 'they',
    'café', 'naïve', 'résumé', 'Zürich', 'Straße', 'œuvre', 'façade', 'jalapeño', 'smörgåsbord',
    'Москва', 'привет', 'мир', 'Ελλάδα', 'λόγος', 'שלום', 'مرحبا', 'السلام', 'नमस्ते', 'हिन्दी',
    '日本語', '東京', 'こんにちは', 'カタカナ', '中文', '你好', '世界', '한국어', '안녕하세요', 'ไทย',
    'Tiếng', 'Việt', 'ğüşıöç', 'ÀÉÎÕÜ', 'ǅ', 'ﬁne', 'Ⅻ', 'x²', 'H₂O', '½', '①', '٣٤٥', '१२३',
    '１２３', 'ＡＢＣ', 'e.g.', 'U.S.A.', 'C++', 'C#', 'node.js', 'a_b_c', 'snake_case',
    'CamelCase', 'URL:', 'https://example.com/a?b=1&c=2', 'user@example.org', '#hashtag',
    '@mention', '$100', '€42,50', '£7', '¥1000', '100%', '3.14159', '-273.15', '1e-9',
    '0x1F', '2024-06-12', '12:30:45', '1,000,000', '007', '42', '9999999999', '31337'];
const emoji = ['😀', '👍', '👍🏽', '🎉', '🚀', '❤️', '👨‍👩‍👧‍👦', '🏳️‍🌈', '🇫🇷', '🇯🇵', '🤖', '✨', '🔥',
    '😂😂😂', '🙏🏿', '⚡', '☕', '©', '®', '™', '∑', '∞', '≠', '→', '★', '♪', '°'];
const punctuation = ['.', ',', '!', '?', '...', '!!!', '?!', ';', ':', '—', '–', '-', '(', ')',
    '[', ']', '{', '}', '"', '«', '»', '„', '“', '”', '‘', '’', '/', '\\', '|', '*', '&', '^',
    '~', '`', '<', '>', '=', '+', '%', '#', '@'];
const contractions = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'LL", "'D", "'x", "'"];
const spaces = [' ', '  ', '   ', '    ', '\t', '\t\t', ' \t ', '\u00a0', '\u3000', '\u2003',
    '\u2009', '\n', '\n\n', '\r\n', ' \n ', '  \n\n  ', '\u200b', '\u00ad', '\ufeff', '\u0085',
    '\u2028', '\v', '\f'];

function sentence() {
    let text = random() < 0.2 ? pick(spaces) : '';
    const n = 1 + Math.floor(random() * 14);
    for (let i = 0; i < n; i++) {
        const r = random();
        if (r < 0.55) text += pick(words);
        else if (r < 0.65) text += pick(emoji);
        else if (r < 0.72) text += String(Math.floor(random() * 10 ** (1 + Math.floor(random() * 8))));
        else if (r < 0.82) text += pick(punctuation);
        else text += pick(words) + pick(contractions);
        const gap = random();
        text += gap < 0.7 ? ' ' : gap < 0.85 ? pick(spaces) : gap < 0.95 ? '' : pick(punctuation) + ' ';
    }
    if (random() < 0.3) text = text.trimEnd();
    if (random() < 0.1) text += pick(spaces);
    return text;
}

const lines = [], texts = [];
for (let i = 0; i < 3000; i++) {
    const text = sentence();
    texts.push(text);
    lines.push(JSON.stringify({ text, ids: encode(text) }));
}
// a few edge cases by hand
for (const text of ['', ' ', '\n', 'a', "it's", " 's", '    leading', 'trailing    ', '1234567890',
    ' '.repeat(40) + 'x', 'x' + '\t'.repeat(9), '!!!!!!!!!!!!!!!!!!!!', 'é'.repeat(30),
    '<|endoftext|>', 'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa'])
    lines.push(JSON.stringify({ text, ids: encode(text) }));
fs.writeFileSync('tests/reference/tokenizer-gpt2.jsonl', lines.join('\n') + '\n');
console.log(`wrote tests/reference/tokenizer-gpt2.jsonl: ${lines.length} texts`);

async function llama() {
    const { llama3Tokenizer } = require(path.join(modules,
        'llama3-tokenizer-js/bundle/commonjs-llama3-tokenizer-with-baked-data.cjs'));
    const { default: llama2 } = await import(path.join(modules, 'llama-tokenizer-js/llama-tokenizer.js'));
    const first = texts.slice(0, LLAMA_TEXTS);
    const ids3 = first.map(t => JSON.stringify(llama3Tokenizer.encode(t, { bos: false, eos: false })));
    fs.writeFileSync('tests/reference/tokenizer-llama3.jsonl', ids3.join('\n') + '\n');
    const ids2 = first.map(t => JSON.stringify(llama2.encode(t, false, true)));
    fs.writeFileSync('tests/reference/tokenizer-llama2.jsonl', ids2.join('\n') + '\n');
    console.log(`wrote tests/reference/tokenizer-llama3.jsonl, tokenizer-llama2.jsonl: ${first.length} texts`);
}
llama();

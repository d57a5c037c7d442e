// Prints the sentences of the npm package nlp-corpus (builds/doc-*.json: arrays of strings),
// one a line, for `make data`: node tools/corpus_text.js data/npm/node_modules/nlp-corpus
const fs = require('fs');
const path = require('path');
const dir = path.join(process.argv[2] || 'data/npm/node_modules/nlp-corpus', 'builds');
const files = fs.readdirSync(dir).filter(f => /^doc-\d+\.json$/.test(f))
    .sort((a, b) => parseInt(a.slice(4)) - parseInt(b.slice(4)));
const out = [];
for (const f of files)
    for (const sentence of JSON.parse(fs.readFileSync(path.join(dir, f), 'utf8')))
        if (typeof sentence === 'string' && sentence.trim()) out.push(sentence.replace(/\s*[\r\n]+\s*/g, ' '));
process.stdout.write(out.join('\n') + '\n');

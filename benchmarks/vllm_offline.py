"""vLLM's side of bench_offline.py, run in an interpreter that has vLLM (it is not a dependency here).

    VENV/bin/python benchmarks/vllm_offline.py REQUEST.json REPORT.json

REQUEST.json holds {model, prompts (token ids), output_lens, max_num_batched_tokens,
kv_cache_memory_bytes}. The engine is built as vLLM's benchmark_throughput builds it (bf16,
prefix caching on), warmed up on two reversed prompts, then times one generate over all prompts,
greedy with EOS ignored. REPORT.json gets startup_s, generate_s, output_tokens, output_tok_per_s
and vllm_version.
"""
import json
import sys
import time

import vllm
from vllm import LLM, SamplingParams, TokensPrompt


def main(request_path: str, report_path: str) -> None:
    with open(request_path) as file:
        request = json.load(file)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
    params = [SamplingParams(max_tokens=length, temperature=0, ignore_eos=True) for length in request["output_lens"]]
    start = time.perf_counter()
    llm = LLM(model=request["model"], dtype="bfloat16", enable_prefix_caching=True,
              max_num_batched_tokens=request["max_num_batched_tokens"],
              kv_cache_memory_bytes=request["kv_cache_memory_bytes"])
    warm_up = [TokensPrompt(prompt_token_ids=ids[::-1]) for ids in request["prompts"][:2]]  # no prefix hits later
    llm.generate(warm_up, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    startup = time.perf_counter() - start
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    assert output_tokens == sum(request["output_lens"]), output_tokens
    with open(report_path, "w") as file:
        json.dump({"startup_s": startup, "generate_s": elapsed, "output_tokens": output_tokens,
                   "output_tok_per_s": output_tokens / elapsed, "vllm_version": vllm.__version__}, file)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

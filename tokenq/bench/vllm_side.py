"""The vLLM side of ``tokenq bench engine --vllm PYTHON``, run by that interpreter (vLLM keeps
its own pins in a venv of its own, so this imports nothing of tokenq): the spec file named
on the command line in, one JSON line per workload out, run as the tokenq side runs it."""

import json
import sys
import time


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    print(json.dumps({"vllm": vllm.__version__}), flush=True)

    llm = LLM(
        spec["model"],
        dtype=spec["dtype"],
        skip_tokenizer_init=True,  # token ids in and out, as on the tokenq side
        max_num_seqs=spec["max_num_seqs"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        seed=0,
        enable_prefix_caching=False,  # the warm-up's prompts are the timed run's
    )
    for wl in spec["workloads"]:
        params = [
            SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n, detokenize=False)
            for n in wl["max_tokens"]
        ]
        prompts = [TokensPrompt(prompt_token_ids=p) for p in wl["prompts"]]
        warm_up = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=2, detokenize=False)
        llm.generate(prompts, warm_up, use_tqdm=False)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(json.dumps({"name": wl["name"], "tokens": tokens, "seconds": seconds}), flush=True)


if __name__ == "__main__":  # vLLM starts its engine core in a spawned process
    main()

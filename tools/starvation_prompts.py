"""Write the prompts file of docs/engine.md's first-come-first-started table: a 900-token prompt
(max_tokens 100, 63 pages of 16) as the 6th of N requests, the others 5-14 tokens with 5-19
outputs (about 2 pages each), seeded, so the table's runs can be made again:

    python3 tools/starvation_prompts.py 1600 > /tmp/starve.jsonl
    mstar run --plan generated/llama.plan --engine sim --prompts /tmp/starve.jsonl --concurrency 32 \\
        --kv-pages 64 --no-progress --out /tmp/starve --report /tmp/starve.json

outputs.jsonl gives each request's ttft_ms and the order they finished; the report the run's length.
"""
import json
import random
import sys


def main() -> None:
    num = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    rng = random.Random(2)
    for index in range(num):
        if index == 5:
            line = {"id": "BIG", "prompt_tokens": [rng.randrange(1000) for _ in range(900)], "max_tokens": 100}
        else:
            line = {"id": f"s{index}", "prompt_tokens": [rng.randrange(1000) for _ in range(rng.randrange(5, 15))],
                    "max_tokens": rng.randrange(5, 20)}
        print(json.dumps(line))


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# The GPU checks waiting for a device, each part sized for one device call (at most 600 s):
#
#   run(command="source tools/gpu/env.sh; tools/gpu/checks.sh tests 2>&1 | tee $OUT/tests.log; save_caches",
#       carry=[".whl", ".gpucache"])
#
# parts (one a call, in this order):
#   tests  the GPU tests of the changes written without a device (norm folding, the skinny products'
#          accumulate, the decode attention's merge, bench kv's device-drawn weights) and of the fast
#          paths they touch
#   llama  `mstar bench engine` on llama's plan: the default, then each what-if (--extra-launches 2:
#          the cost of a small kernel in the graphs; --fold-norms; --decode-merge-in-kernel; both),
#          the default again (ratios are read within this one call)
#   qwen   the same on qwen3_5's plan, with --skinny-products, then the skinny kernel's sweep of
#          its 50 launch configs against cuBLAS at 64 and 1 rows
#   kv     `mstar bench kv`: the prefix scenario (default, both what-ifs, default), then the chunk
#          scenario at budgets 160 and 192 (the sim meets both chunk targets there)
#   launch `mstar bench engine` on llama's plan, the default and `--extra-launches 2` alternated
#          twice: what one small kernel costs inside the decode graphs
#   chunk  the chunk scenario alone at budgets 224 and 192, alternated: on 2026-12-05 budget 224
#          met both targets in every run (three on an H200, six on two H100s), 192 in two of three
#          on either GPU (docs/runtime.md)
#   persist the persistent chain of products (engine/gpu/persistent_chain.py): its GPU tests (the grid
#          barrier and the L2 prefetch run only there), then `mstar bench products --chain` on llama's
#          and qwen3_5's plans: a step's products a kernel each (cuBLAS, skinny) against one launch
#   nodes  the changes of a session without a device (2026-12-05, the sixteenth): a request's memory
#          freed per node when its partitions there end (Engine.end_node: the GPU runner's row slots
#          go mid-request on Qwen3-Omni, Orpheus and BAGEL), the admission's claim cap (shared
#          prefix pages), then Qwen3-Omni on a tight pool with --device cuda (every request ok); and
#          of the next session's: the GPU runner's and decode columns' `is_length` (step.row_stop),
#          which these tests' decode steps run through
#   extras what requests asking for log-probabilities, or with a logit_bias or a temperature, cost
#          the decode steps they share (docs/engine.md "Log-probabilities"): `mstar run` on llama's
#          graphs, 64 requests of 128 + 128 tokens each kind, plain first and last, inter-token times;
#          (top_p twice: the sampler's nucleus by sort and by search, --nucleus; penalised requests
#          twice: by torch ops and by the Triton kernels, --penalties),
#          then the fast path's GPU tests of log-probabilities and logit_bias; first `mstar bench sampler`
#          (the sampler's torch ops against its Triton draws, sampling_kernels.py) and after, their GPU tests;
#          RUNS="plain penalty plain" runs those workloads alone after the bench, no tests
#   sampling the device penalties of a session that got no device for them (gpu/penalties.py:
#          repetition, presence and frequency on the fast path, steps with one launched ahead since) and
#          the device log-probabilities of the next (StepExecutor.collect_logprobs): the fast path's GPU
#          tests, the decode columns', and `mstar run` on llama's graphs with a prompts file mixing
#          penalised, sampled, logprobs and plain requests (every one must end `length`), then again with
#          `--penalties torch` (the same outputs expected)
#   penalties the penalty kernels (gpu/penalty_kernels.py, the default since their first GPU run;
#          --penalties torch the torch ops): their GPU tests against the CPU's torch ops, `penalise` timed both ways at 1, 8
#          and 64 rows, the penalised workload both ways between plain ones (extras' RUNS), and the
#          mixed workload both ways (sampling's, without its tests); about 300 s
#   topk   top_k first, then top_p over the top k's mass (the nucleus search's count-only search
#          first where a row has both): the sampler's GPU tests, `mstar bench sampler` (its
#          top_k_top_p kind), the plain, top_p and top_k + top_p workloads (extras'), then where the
#          decode (`bench engine` on llama) and the prefix scenario stand; with Qwen3-ASR's GPU tests
#          (a checkpoint through the device path's loader, now on the reference loader's rules)
#   warmup bench kv's torch runs, each variant and prefix run once uncounted first (a process's first
#          runs paid its one-time costs): the prefix scenario twice, beside the GPU tests of the
#          conductor and the glue's loading, Qwen3-TTS at max_tokens 1 and 2 (one frame, two) and
#          `bench engine` on llama
#   offload the device path's KV offload and shared prefix pages after the admission's pages_short lost
#          its clamp at zero (the fast path's GPU tests of offload, prefix pages, budgets and chunks)
#   prompts a prompt's own log-probabilities on the fast path: tests/gpu/test_prompt_logprobs_gpu.py
#          (llama and llama_chunked at spec dims) and the piecewise graphs' and the fast path's GPU
#          tests, then what asking costs a lone 1,024-token prompt (the Python API, alternated with
#          plain ones, scored on the piecewise graphs and eagerly), what KEEP_HIDDEN_ON_PIECES costs a
#          plain one (an engine each way, twice), two plain workloads
#   counters the hybrid decode graphs' arrival counters kept out of the graphs and the host pool's moved
#          requests keeping their admission place (the eighth session of 2026-12-07, no device came):
#          their GPU tests, then Qwen3.5's decode with and without the piecewise graphs captured
# A part stops starting variants once LIMIT_S (default 540) seconds have gone, so what ran comes back.
set -uo pipefail
part=${1:?usage: checks.sh tests|llama|qwen|kv|chunk|launch|persist|nodes|sampling|extras|penalties|prompts|topk|warmup|offload|counters}
limit=${LIMIT_S:-540}
t0=$(date +%s)
in_time() { [ $(( $(date +%s) - t0 )) -lt "$limit" ] || { echo "== time limit: stopped before $*"; return 1; }; }
engine() {  # engine PLAN [flags]: one bench run, its JSON on one line after a header
  local plan=$1; shift
  in_time "bench engine $plan $*" || return 1
  echo "== bench engine $plan $* (t=$(( $(date +%s) - t0 )) s)"
  python3 -m mstar.cli.mstar bench engine --plan "generated/$plan.plan" --no-hf --no-numpy --iters 10 --json "$@"
}
kv() {
  in_time "bench kv $*" || return 1
  echo "== bench kv $* (t=$(( $(date +%s) - t0 )) s)"
  python3 -m mstar.cli.mstar bench kv --engine torch --device cuda --dims spec "$@"
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case $part in
  tests)
    python3 -m pytest -q tests/gpu/test_norm_folding_gpu.py tests/gpu/test_skinny_products_gpu.py \
      tests/gpu/test_decode_attention_gpu.py tests/gpu/test_bench_kv_gpu.py
    in_time "the fast path tests" && python3 -m pytest -q tests/gpu/test_gpu_fast_path.py \
      tests/gpu/test_gpu_fast_path_hybrid.py tests/gpu/test_bench_gdn_gpu.py ;;
  prompts)
    python3 -m pytest -q tests/gpu/test_prompt_logprobs_gpu.py
    # the piecewise graphs' and the fast path's tests (KEEP_HIDDEN_ON_PIECES on: the default)
    in_time "the piecewise and fast path tests" && python3 -m pytest -q tests/gpu/test_gpu_piecewise.py \
      tests/gpu/test_gpu_fast_path.py
    in_time "what a scored prompt costs" && echo "== what a scored prompt costs (t=$(( $(date +%s) - t0 )) s)" \
      && python3 - <<'PY'
import statistics, time
from mstar.runtime.engine.gpu import setup
from mstar.runtime.engine.gpu.runner import GpuDecoderRunner
from mstar.runtime.serve.api import LLM, SamplingParams
begun = time.perf_counter()
with LLM("generated/llama.plan", device="cuda", dims="spec") as llm:
    print(f"the engine built in {time.perf_counter() - begun:.1f} s", flush=True)
    executor = next(r for r in llm.engine.runners.values() if isinstance(r, GpuDecoderRunner)).executor
    kinds = ("plain", "scored on the pieces", "scored eagerly")
    times = {kind: [] for kind in kinds}
    for index in range(36):  # alternated, one at a time: each a lone 1,024-token prompt of its own
        kind = kinds[index % 3]
        executor.scores_on_pieces = kind != "scored eagerly"
        prompt = [(31 * index + 7 * i) % 5000 + 100 for i in range(1024)]
        started = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, **({"prompt_logprobs": 1} if index % 3 else {})))
        times[kind].append((time.perf_counter() - started) * 1000)
    medians = {kind: statistics.median(found[2:]) for kind, found in times.items()}
    print("a lone 1,024-token prompt to its one token, ms (medians of 10):",
          {kind: round(value, 2) for kind, value in medians.items()},
          "ratios", {kind: round(medians[kind] / medians["plain"], 2) for kind in kinds[1:]},
          "piecewise steps", executor.num_piecewise_steps, "eager steps", executor.num_eager_steps)
    print("capture bytes measured", executor.capture_bytes, "the plan's estimates",
          {f.name: f.memory_bytes for w in llm.plan.workers for k in w.keys for f in k.captures})
PY
    in_time "what keeping the states costs a plain prompt" && echo "== a plain prompt's cost of the switch" \
      && python3 - <<'PY'
import statistics, time
from mstar.runtime.engine.gpu import setup
from mstar.runtime.serve.api import LLM, SamplingParams
found = {False: [], True: []}
for keeps in (False, True, False, True):  # an engine each (the switch decides the capture)
    setup.KEEP_HIDDEN_ON_PIECES = keeps
    with LLM("generated/llama.plan", device="cuda", dims="spec") as llm:
        times = []
        for index in range(12):
            prompt = [(31 * index + 7 * i + keeps) % 5000 + 100 for i in range(1024)]
            started = time.perf_counter()
            llm.generate([prompt], SamplingParams(max_tokens=1))
            times.append((time.perf_counter() - started) * 1000)
        found[keeps].append(statistics.median(times[2:]))
print("a lone plain 1,024-token prompt to its one token, ms (medians of 10, two engines each):",
      {("keeping" if keeps else "plain graphs"): [round(t, 2) for t in ts] for keeps, ts in found.items()},
      "ratio", round(statistics.mean(found[True]) / statistics.mean(found[False]), 3))
PY
    in_time "the plain workloads" && NO_BENCH=1 RUNS="plain plain" LIMIT_S=$(( limit - $(date +%s) + t0 )) "$0" extras ;;
  penalties)
    python3 -m pytest -q tests/gpu/test_gpu_fast_path.py -k "device_penalties or penal"
    in_time "penalise timed" && python3 -c "
import torch
from mstar.runtime.engine.gpu.bench_sampler import _beside_the_draw
device = torch.device('cuda')
for rows in (1, 8, 64):
    print(rows, 'rows:', _beside_the_draw(torch.randn(rows, 128256, device=device, dtype=torch.bfloat16), 20, device))"
    in_time "the penalised workloads" && NO_BENCH=1 RUNS="plain penalty::torch penalty plain" \
      LIMIT_S=$(( limit - $(date +%s) + t0 )) "$0" extras
    in_time "the mixed workload" && LIMIT_S=$(( limit - $(date +%s) + t0 )) "$0" sampling-workload ;;
  sampling|sampling-workload)
    [ "$part" = sampling ] && python3 -m pytest -q tests/gpu/test_gpu_fast_path.py tests/gpu/test_gpu_decode_columns.py
    in_time "mstar run with penalties and logprobs" && python3 - <<'PY' > /tmp/penalties.jsonl
import json
kinds = [{}, {"presence_penalty": 1.0, "logprobs": 2}, {"frequency_penalty": 0.5, "repetition_penalty": 1.1},
         {"temperature": 0.8, "top_k": 40, "presence_penalty": 0.3}, {"logprobs": 0, "temperature": 0.9}]
for i in range(16):
    print(json.dumps({"id": f"r{i}", "prompt_tokens": [1 + i, 5, 9, 13] * 8, "max_tokens": 64, "seed": i,
                      **kinds[i % len(kinds)]}))
PY
    python3 -m mstar.cli.mstar run --plan generated/llama.plan --device cuda --dims spec \
      --prompts /tmp/penalties.jsonl --no-progress --report /tmp/penalties.json --out /tmp/penalties | tail -3
    python3 -c "import json; print(json.load(open('/tmp/penalties.json'))['finish_reasons'])"
    python3 -c "import json; lines = [json.loads(l) for l in open('/tmp/penalties/outputs.jsonl')]; \
print('lines with logprobs', sum('logprobs' in l for l in lines), [l['logprobs'][0] for l in lines if 'logprobs' in l][:2])"
    in_time "the same with --penalties torch" && python3 -m mstar.cli.mstar run --plan generated/llama.plan \
      --device cuda --dims spec --prompts /tmp/penalties.jsonl --no-progress --penalties torch \
      --report /tmp/penalties_torch.json --out /tmp/penalties_torch | tail -1
    python3 -c "import json; print('torch ops', json.load(open('/tmp/penalties_torch.json'))['finish_reasons'])"
    python3 -c "import json; a, b = ({l['id']: l['output_tokens'] for l in map(json.loads, open(f'/tmp/{d}/outputs.jsonl'))} \
for d in ('penalties', 'penalties_torch')); print('same tokens by the torch ops (steps batched alike):', a == b)" ;;
  extras)
    [ -n "${NO_BENCH:-}" ] || python3 -m mstar.cli.mstar bench sampler --iters 20  # (NO_BENCH=1: the workloads alone)
    python3 - <<'PY'
import json
kinds = {"plain": {}, "logprobs": {"logprobs": 1}, "bias": {"logit_bias": {"13": -100}},
         "temperature": {"temperature": 1.0, "seed": 1}, "top_p": {"temperature": 0.7, "top_p": 0.9, "seed": 1},
         "top_k_top_p": {"temperature": 0.7, "top_p": 0.9, "top_k": 50, "seed": 1},
         "penalty": {"repetition_penalty": 1.1, "presence_penalty": 0.5}}
for name, extra in kinds.items():
    with open(f"/tmp/{name}.jsonl", "w") as f:
        for i in range(64):
            f.write(json.dumps({"id": f"r{i}", "prompt_tokens": [(7 * i + j) % 1000 + 1 for j in range(128)],
                                "max_tokens": 128, **extra}) + "\n")
PY
    # RUNS: the workloads to run, in order (default all)
    for run in ${RUNS:-plain top_p:sort top_p temperature logprobs bias penalty::torch penalty plain}; do
      # NAME[:NUCLEUS[:PENALTIES]], each left empty for the default
      IFS=: read -r name nucleus penalties <<< "$run"
      flags=${nucleus:+--nucleus $nucleus}${penalties:+ --penalties $penalties}
      in_time "mstar run $run" || break
      timeout 120 python3 -m mstar.cli.mstar run --plan generated/llama.plan --device cuda --dims spec \
        --prompts "/tmp/$name.jsonl" --concurrency 64 --no-progress $flags --report "/tmp/$name.json" \
        > "/tmp/$name.log" 2>&1 || tail -2 "/tmp/$name.log"
      python3 -c "import json; r = json.load(open('/tmp/$name.json')); print('$run', r['itl_ms'], r['finish_reasons'])"
    done
    [ -n "${RUNS:-}" ] && exit 0  # (a chosen few workloads: no tests)
    in_time "the GPU tests" && python3 -m pytest -q tests/gpu/test_sampling_kernels_gpu.py
    in_time "the fast path's GPU tests" && python3 -m pytest -q tests/gpu/test_gpu_fast_path.py \
      -k "logprobs or logit_bias or penal" ;;
  topk)
    timeout 200 python3 -m pytest -q tests/gpu/test_sampling_kernels_gpu.py tests/gpu/test_qwen3_asr_gpu.py
    in_time "bench sampler" && timeout 150 python3 -m mstar.cli.mstar bench sampler --iters 20
    in_time "the workloads" && NO_BENCH=1 RUNS="plain top_p top_k_top_p plain" LIMIT_S=$(( limit - $(date +%s) + t0 )) \
      bash "$0" extras
    in_time "bench engine" && engine llama
    in_time "the prefix scenario" && kv --scenario prefix ;;
  llama)
    for flags in "" "--extra-launches 2" "--fold-norms --decode-merge-in-kernel" "" "--fold-norms" \
                 "--decode-merge-in-kernel" "--extra-launches 2"; do
      # shellcheck disable=SC2086  # the flags split into options
      engine llama $flags || break
    done ;;
  qwen)
    for flags in "" "--fold-norms --decode-merge-in-kernel" "--skinny-products" ""; do
      # shellcheck disable=SC2086
      engine qwen3_5 $flags || break
    done
    in_time "the skinny sweep" && python3 -m mstar.cli.mstar bench products --plan generated/qwen3_5.plan \
      --skinny-sweep --rows 64,1 ;;
  kv)
    for flags in "" "--fold-norms --decode-merge-in-kernel" ""; do
      # shellcheck disable=SC2086
      kv --scenario prefix $flags || break
    done
    for budget in 160 192; do
      kv --scenario chunk --no-whole --no-flat --budget "$budget" || break
    done ;;
  launch)
    for flags in "" "--extra-launches 2" "" "--extra-launches 2"; do
      # shellcheck disable=SC2086
      engine llama $flags || break
    done ;;
  chunk)  # one process: the budgets interleaved, three rounds (serve/bench_kv_sweep.py)
    kv --scenario chunk --budgets 224,192 --chunk-rounds 3 ;;
  persist)
    timeout 240 python3 -m pytest -q -x tests/gpu/test_persistent_chain_gpu.py
    for plan in llama qwen3_5; do
      in_time "bench products --chain $plan" || break
      echo "== bench products --chain $plan (t=$(( $(date +%s) - t0 )) s)"
      timeout 150 python3 -m mstar.cli.mstar bench products --plan "generated/$plan.plan" --chain --rows 64,8,1 --iters 30
    done ;;
  nodes)
    timeout 420 python3 -m pytest -q tests/gpu/test_gpu_engine.py tests/gpu/test_gpu_shared_prefix_pages.py \
      tests/gpu/test_gpu_fast_path.py
    in_time "the tight Qwen3-Omni run" && timeout 100 python3 -m mstar.cli.mstar run \
      --plan generated/qwen3_omni.plan --device cuda --ranks inproc --kv-pages 24 --requests 12 --concurrency 6 \
      --no-progress ;;
  warmup)  # bench kv's uncounted first runs (2026-12-07, the sixth session), with the GPU tests near its changes
    timeout 240 python3 -m pytest -q tests/gpu/test_gpu_engine.py tests/gpu/test_glue_step_path_gpu.py \
      tests/gpu/test_bench_kv_gpu.py
    in_time "Qwen3-TTS at max_tokens 1 and 2" && printf '%s\n' '{"id":"a","prompt_tokens":[1,2,3],"max_tokens":1}' \
      '{"id":"b","prompt_tokens":[1,2,3],"max_tokens":2}' > /tmp/tts.jsonl && timeout 120 python3 -m mstar.cli.mstar \
      run --plan generated/qwen3_tts.plan --device cuda --prompts /tmp/tts.jsonl --out /tmp/tts --no-progress \
      > /dev/null && python3 -c "import wave, glob; print([(f, wave.open(f).getnframes()) for f in sorted(glob.glob('/tmp/tts/*.wav'))])"
    in_time "bench engine" && engine llama
    for round in 1 2; do
      kv --scenario prefix || break
    done ;;
  offload)  # the admission's pages_short without its clamp, on the device path's offload (2026-12-07, sixth session)
    timeout 420 python3 -m pytest -q tests/gpu/test_gpu_offload.py tests/gpu/test_gpu_shared_prefix_pages.py \
      tests/gpu/test_gpu_fast_path.py -k "offload or prefix or pages or budget or chunk" ;;
  counters)  # 2026-12-07, eighth session, no device came: the hybrid decode graphs' arrival counters
    # (gdn_forward.GdnForward.decode_counts, no memset node a replay) and the host pool's moved requests
    # keeping their admission place (kv/admission.py): the hybrid decode-graph tests and the offload
    # tests, then Qwen3.5's decode with the piecewise graphs captured against `--decode-graphs-only`,
    # alternated (their 60-75 us a replay apart before, docs/engine.md "A cost to the decode graphs")
    timeout 200 python3 -m pytest -q tests/gpu/test_gpu_fast_path_hybrid.py \
      -k "counts or decode_graph_replay or qwen3_5_plan_runs or runs_ahead"
    # (the ninth session: the penalised rows' table reserved before the step, gpu/penalties.py `reserve`)
    timeout 200 python3 -m pytest -q tests/gpu/test_gpu_offload.py tests/gpu/test_gpu_fast_path.py -k "offload or penal"
    for flags in "" --decode-graphs-only "" --decode-graphs-only; do
      engine qwen3_5 --iters 5 $flags | tail -1 | python3 -c "import json, sys; d = json.load(sys.stdin)['decode']
print(' '.join(f'{r}: {d[r][\"chain_ms\"]} chained, {d[r].get(\"replay_ms\")} replay' for r in ('1', '8', '64')))"
    done
    # the cached request's host path with the glue packer's points (serve/host_timeline.py)
    kv --scenario prefix --prefix-rounds 1 ;;
  *) echo "unknown part $part: tests, llama, qwen, kv, chunk, launch, persist, nodes, sampling, extras, warmup, offload or counters"
     exit 2 ;;
esac

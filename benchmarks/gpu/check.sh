#!/usr/bin/env bash
# The GPU check of pacerl with SGLang (benchmarks/gpu/README.md): its own venv with the `sglang` extra,
# a random-weight Qwen3-MoE saved locally, an SGLang server with routed experts returned, two short
# `pacerl train` runs against it under FSDP (with R3 and without), and the figures as JSON in
# benchmarks/results/gpu_check.json. Run from the repository root:  bash benchmarks/gpu/check.sh
# Needs an NVIDIA GPU, Python 3.11 and a reachable package index; nothing else is downloaded.
# Every wait is bounded; the first step that fails stops the check with a message naming it.
set -Eeuo pipefail

# -- settings (environment variables) ------------------------------------------------------------------
VENV=${CHECK_VENV:-.venv-gpu}                       # the check's own virtual environment
PYTHON=${CHECK_PYTHON:-python3.11}                  # builds it (pyproject: >=3.11,<3.12)
WORK=${CHECK_WORK:-runs/gpu-check}                  # model, runs, logs (runs/ is not versioned)
OUT=${CHECK_OUT:-benchmarks/results/gpu_check.json}
PORT=${CHECK_PORT:-30000}
STEPS=${CHECK_STEPS:-4}                             # training steps of each run
LAYERS=${CHECK_LAYERS:-2}                           # Qwen3-30B-A3B has 48
EXPERTS=${CHECK_EXPERTS:-32}                        # Qwen3-30B-A3B has 128
MEM_FRACTION=${CHECK_SGLANG_MEM_FRACTION:-0.3}      # SGLang's share of GPU 0; the trainer shares the GPUs
TRANSPORT=${CHECK_WEIGHT_TRANSPORT:-disk}           # disk | distributed (sglang.weight_transport)
GROUP_BACKEND=${CHECK_WEIGHT_GROUP_BACKEND:-gloo}   # distributed only; nccl needs the server on other GPUs
INSTALL_TIMEOUT=${CHECK_INSTALL_TIMEOUT_S:-2400}
MODEL_TIMEOUT=${CHECK_MODEL_TIMEOUT_S:-900}
HEALTH_TIMEOUT=${CHECK_HEALTH_TIMEOUT_S:-900}
TRAIN_TIMEOUT=${CHECK_TRAIN_TIMEOUT_S:-1800}
HTTP_TIMEOUT=${CHECK_HTTP_TIMEOUT_S:-300}

STEP="start"
SERVER_PID=""
SAMPLER_PID=""

fail() {
    echo "gpu check FAILED at step '$STEP': $*" >&2
    exit 1
}
trap 'fail "command failed (line $LINENO, exit $?): $BASH_COMMAND"' ERR

cleanup() {
    # The server and the sampler run in process groups of their own (setsid): end each whole group.
    for pid in "$SERVER_PID" "$SAMPLER_PID"; do
        if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
            kill -TERM -- "-$pid" 2>/dev/null || true
        fi
    done
    sleep 2
    for pid in "$SERVER_PID" "$SAMPLER_PID"; do
        if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
            kill -KILL -- "-$pid" 2>/dev/null || true
        fi
    done
}
trap cleanup EXIT

step() {
    STEP="$1"
    echo "== $(date +%H:%M:%S) $STEP" >&2
}

post_json() {  # post_json PATH JSON: POST to the server, print the answer, fail unless it says success
    local answer
    answer=$(curl -sS --max-time "$HTTP_TIMEOUT" -H 'Content-Type: application/json' -d "$2" \
        "http://127.0.0.1:$PORT$1") || fail "POST $1 gave no answer"
    echo "$answer"
    grep -q '"success": *true' <<<"$answer" || fail "POST $1 answered: $answer"
}

# -- 1. preflight ---------------------------------------------------------------------------------------
step "preflight"
if ! grep -qs '^name = "pacerl"' pyproject.toml; then
    fail "run it from the root of the pacerl repository (no pacerl pyproject.toml here)"
fi
command -v nvidia-smi >/dev/null || fail "nvidia-smi not found: this check needs an NVIDIA GPU"
command -v curl >/dev/null || fail "curl not found"
command -v setsid >/dev/null || fail "setsid not found (util-linux)"
command -v "$PYTHON" >/dev/null || fail "$PYTHON not found: set CHECK_PYTHON to a Python 3.11"
GPUS=${CHECK_GPUS:-$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)}
[[ "$GPUS" -ge 1 ]] || fail "nvidia-smi lists no GPU"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv >&2
if curl -sS --max-time 2 "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; then
    fail "something already answers on port $PORT: set CHECK_PORT"
fi
mkdir -p "$WORK" "$(dirname "$OUT")"
WORK=$(cd "$WORK" && pwd)   # absolute: the server resolves paths against its own directory
MODEL="$WORK/model"

# -- 2. virtual environment -------------------------------------------------------------------------------
step "venv"
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV" || fail "cannot create $VENV"
# The project with the `sglang` extra, nothing else: sglang pins its own torch (a CUDA build).
timeout "$INSTALL_TIMEOUT" "$VENV/bin/python" -m pip install --upgrade pip >&2 \
    || fail "pip upgrade failed or took over ${INSTALL_TIMEOUT}s"
timeout "$INSTALL_TIMEOUT" "$VENV/bin/python" -m pip install -e ".[sglang]" >&2 \
    || fail "installing the project with the sglang extra failed or took over ${INSTALL_TIMEOUT}s"
"$VENV/bin/python" - <<'PY' >&2 || fail "the venv has no working sglang + CUDA torch (see above)"
import sglang, torch
assert torch.cuda.is_available(), "torch sees no CUDA device"
print("sglang", sglang.__version__, "torch", torch.__version__, "cuda", torch.version.cuda,
      "devices", torch.cuda.device_count())
PY

# -- 3. a random-weight MoE of a real family's shape, saved locally -------------------------------------
step "model"
if [[ ! -f "$MODEL/config.json" ]]; then
    timeout "$MODEL_TIMEOUT" "$VENV/bin/python" benchmarks/gpu/check.py build-model --out "$MODEL" \
        --layers "$LAYERS" --experts "$EXPERTS" --info-out "$WORK/model.json" >&2 \
        || fail "building or saving the model failed or took over ${MODEL_TIMEOUT}s"
fi

# -- nvidia-smi samples for peak memory, all along ------------------------------------------------------
GPU_LOG="$WORK/gpu-memory.log"
: >"$GPU_LOG"
# shellcheck disable=SC2016  # the sampler's own variables, expanded by the bash it starts
setsid bash -c '
    while true; do
        nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits 2>/dev/null \
            | tr -d "," | while read -r index used; do echo "gpu $index $used"; done
        nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null \
            | tr -d "," | while read -r pid used; do
                echo "app $pid $(ps -o pgid= -p "$pid" 2>/dev/null | tr -d " " || echo "?") $used"
            done
        sleep 1
    done' >>"$GPU_LOG" 2>/dev/null &
SAMPLER_PID=$!

# -- 4. the SGLang server -------------------------------------------------------------------------------
step "sglang server"
# --enable-return-routed-experts: routes of every token for R3 (sglang's exec_ arg group);
# --weight-version 0: integer versions, which pacerl's client reads as the tokens' policy version.
setsid "$VENV/bin/python" -m sglang.launch_server --model-path "$MODEL" --host 127.0.0.1 --port "$PORT" \
    --enable-return-routed-experts --weight-version 0 --dtype bfloat16 \
    --mem-fraction-static "$MEM_FRACTION" >"$WORK/sglang.log" 2>&1 &
SERVER_PID=$!
deadline=$((SECONDS + HEALTH_TIMEOUT))
until curl -sf --max-time 5 "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
        tail -n 60 "$WORK/sglang.log" >&2
        fail "the SGLang server exited before it was healthy (log: $WORK/sglang.log)"
    fi
    if ((SECONDS > deadline)); then
        tail -n 60 "$WORK/sglang.log" >&2
        fail "the SGLang server was not healthy within ${HEALTH_TIMEOUT}s (log: $WORK/sglang.log)"
    fi
    sleep 3
done
curl -sf --max-time "$HTTP_TIMEOUT" "http://127.0.0.1:$PORT/health_generate" >/dev/null \
    || fail "the SGLang server is up but /health_generate failed: it cannot generate"
curl -sf --max-time "$HTTP_TIMEOUT" "http://127.0.0.1:$PORT/model_info" >&2 \
    || fail "GET /model_info failed"
echo >&2

# -- 5. two short training runs: with R3, then without -------------------------------------------------
common=(
    engine_backend=sglang "model.path=$MODEL" "sglang.url=http://127.0.0.1:$PORT"
    "sglang.weight_transport=$TRANSPORT" env.id=pacerl/Math-v0 sft.when=never
    "loop.steps=$STEPS" loop.batch_groups=8 rollout.group_size=8
    learner.parallel=fsdp "learner.world_size=$GPUS"
    # Random weights earn no reward: keep zero-advantage groups so that every step trains and measures.
    learner.drop_zero_advantage=false
    evaluation.at_start=false evaluation.at_end=false evaluation.every=0 threads=8
)
if [[ "$TRANSPORT" == "distributed" ]]; then
    common+=("sglang.weight_group_backend=$GROUP_BACKEND")
fi

train_run() {  # train_run NAME R3(true|false): one run; its process group id goes to $WORK/NAME.pgid
    local name=$1 replay=$2
    step "train ($name: learner.routing_replay=$replay)"
    rm -rf "$WORK/run-$name"
    setsid timeout "$TRAIN_TIMEOUT" "$VENV/bin/python" benchmarks/gpu/check.py train \
        --memory-out "$WORK/$name-memory.json" -- "${common[@]}" "learner.routing_replay=$replay" \
        "run_dir=$WORK/run-$name" "sglang.weights_dir=$WORK/weights-$name" \
        >"$WORK/train-$name.log" 2>&1 &
    local pid=$!
    echo "$pid" >"$WORK/$name.pgid"
    local status=0
    wait "$pid" || status=$?
    if [[ $status -eq 124 ]]; then
        tail -n 60 "$WORK/train-$name.log" >&2
        fail "pacerl train ($name) took over ${TRAIN_TIMEOUT}s (log: $WORK/train-$name.log)"
    elif [[ $status -ne 0 ]]; then
        tail -n 60 "$WORK/train-$name.log" >&2
        fail "pacerl train ($name) exited with $status (log: $WORK/train-$name.log)"
    fi
    kill -0 "$SERVER_PID" 2>/dev/null || fail "the SGLang server died during the $name run"
}

train_run r3 true
# Back to the initial weights, as version 0, so that the second run starts where the first did.
step "reset the server's weights"
post_json /update_weights_from_disk \
    "{\"model_path\": \"$MODEL\", \"weight_version\": \"0\", \"abort_all_requests\": true}" >&2
train_run live false

# -- 6. the figures --------------------------------------------------------------------------------------
step "summary"
"$VENV/bin/python" benchmarks/gpu/check.py summarize --r3 "$WORK/run-r3" --live "$WORK/run-live" \
    --r3-memory "$WORK/r3-memory.json" --live-memory "$WORK/live-memory.json" --gpu-log "$GPU_LOG" \
    --model-info "$WORK/model.json" --gpus "$GPUS" --weight-transport "$TRANSPORT" \
    --sglang-pgid "$SERVER_PID" --r3-pgid "$(cat "$WORK/r3.pgid")" --live-pgid "$(cat "$WORK/live.pgid")" \
    --out "$OUT" || fail "summarizing the runs failed"
echo "gpu check passed: $OUT" >&2

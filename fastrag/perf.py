"""The least time a run's model work can take on its device: the floor that engine timings are read against.

The engine counts its work as it goes (`Engine.stats`): decode steps, tokens decoded and prefilled, and how many
KV entries the decode and prefill attention read. With the model's sizes (`model_costs`) and two figures measured
on the device (`measure_device`: copy bandwidth, matrix-multiply rate) that work has a lower bound on its time:

- a decode step reads every weight once (the embedding table excepted: it reads one row per token) plus the KV of
  every context entry its attention covers (a shared prefix once per step for all its sequences, each sequence's
  own entries once), and does 2 FLOPs per weight per token;
- a prefill (and an attention pass of DRAGIN's RIND/QFS, which the engine counts as prefill) does 2 FLOPs per
  weight per token, the LM head left out (it runs for one row per sequence, not per token), plus
  4 x heads x head_dim per layer per (token, context entry) of attention, and reads the weights once per call.

Each phase costs at least max(bytes / bandwidth, FLOPs / matmul rate); prefill and decode run one after the
other, so the run's floor is the sum of the two. It leaves out everything that is not the model (sampling, the
methods' own logic, retrieval), so `engine wall / floor` says how far the whole run is from what the device could
do with the same model work, and the phase seconds the engine records say which part holds it back.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch


@dataclass
class DeviceFigures:
    device: str
    dtype: str
    copy_bytes_per_s: float  # a large device copy, bytes read + bytes written per second
    matmul_flops_per_s: float  # a large square matrix multiply in the model's dtype

    def as_dict(self) -> dict:
        return asdict(self)


def _median_time(fn, dev: torch.device, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_device(device: str | torch.device, dtype: torch.dtype, copy_bytes: int | None = None,
                   matmul_n: int | None = None, reps: int = 5) -> DeviceFigures:
    """Median copy bandwidth and matmul rate of this device (sizes large enough to leave the caches: 1 GiB and
    n = 8192 on a GPU, 256 MiB and n = 2048 on a CPU unless given)."""
    dev = torch.device(device)
    gpu = dev.type == "cuda"
    nbytes = copy_bytes or ((1 << 30) if gpu else (1 << 28))
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=dev).uniform_()
    dst = torch.empty_like(src)
    t_copy = _median_time(lambda: dst.copy_(src), dev, reps)
    del src, dst
    n = matmul_n or (8192 if gpu else 2048)
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    t_mm = _median_time(lambda: torch.matmul(a, b), dev, reps)
    name = torch.cuda.get_device_name(dev) if gpu else f"CPU x{torch.get_num_threads()} threads"
    return DeviceFigures(device=name, dtype=str(dtype).removeprefix("torch."),
                         copy_bytes_per_s=2 * nbytes / t_copy, matmul_flops_per_s=2 * n ** 3 / t_mm)


def model_costs(model) -> dict:
    """Sizes of a fastrag LlamaModel that set the floor (see the module doc)."""
    c = model.c
    p = next(model.parameters())
    elt = p.element_size()
    embed = model.embed.weight
    params = sum(x.numel() for x in model.parameters())
    tied = model.lm_head.weight is embed
    # weights a decode step streams: all but the embedding table (a tied table is read whole as the LM head)
    step_params = params - (0 if tied else embed.numel())
    matrix_params = sum(x.numel() for x in model.parameters() if x.dim() == 2) - (0 if tied else embed.numel())
    return {"weight_bytes_per_step": step_params * elt, "matmul_params": matrix_params,
            "lm_head_params": model.lm_head.weight.numel(),
            "kv_bytes_per_token": 2 * c.num_layers * c.num_kv_heads * c.head_dim * elt,
            "attn_flops_per_entry": 4 * c.num_layers * c.num_heads * c.head_dim, "dtype_bytes": elt}


def _decode_work(steps: int, tokens: int, kv_entries: int, costs: dict) -> tuple[float, float]:
    """(bytes, FLOPs) of decode steps: every weight read once a step plus the KV entries read; 2 FLOPs per weight
    per token plus the attention's."""
    return (steps * costs["weight_bytes_per_step"] + kv_entries * costs["kv_bytes_per_token"],
            2 * costs["matmul_params"] * tokens + costs["attn_flops_per_entry"] * kv_entries)


def _forward_work(calls: int, tokens: int, ctx_entries: int, costs: dict) -> tuple[float, float]:
    """(bytes, FLOPs) of prefill forwards: the weights read once a forward plus the tokens' KV written; 2 FLOPs per
    weight per token (the LM head left out) plus the attention's over `ctx_entries`."""
    return (calls * costs["weight_bytes_per_step"] + tokens * costs["kv_bytes_per_token"],
            2 * (costs["matmul_params"] - costs["lm_head_params"]) * tokens
            + costs["attn_flops_per_entry"] * ctx_entries)


def floor(stats: dict, costs: dict, dev: DeviceFigures | dict) -> dict:
    """Lower bounds (seconds) on the device time of the work counted in `stats` (Engine.stats)."""
    d = dev.as_dict() if isinstance(dev, DeviceFigures) else dev
    bw, rate = d["copy_bytes_per_s"], d["matmul_flops_per_s"]
    # (a prefix's attention FLOPs are counted once per step, not per sequence: still a lower bound, and small next
    # to the 2 FLOPs per weight per token)
    dec_bytes, dec_flops = _decode_work(stats["decode_steps"], stats["decode_tokens"],
                                        stats["decode_ctx_tokens"] + stats["decode_prefix_tokens"], costs)
    pre_bytes, pre_flops = _forward_work(stats["prefill_calls"], stats["prefill_tokens"], stats["prefill_ctx_tokens"],
                                         costs)
    dec = max(dec_bytes / bw, dec_flops / rate)
    pre = max(pre_bytes / bw, pre_flops / rate)
    return {"decode_s": dec, "prefill_s": pre, "total_s": dec + pre,
            "decode_bound": "bandwidth" if dec_bytes / bw >= dec_flops / rate else "compute",
            "prefill_bound": "bandwidth" if pre_bytes / bw >= pre_flops / rate else "compute",
            "decode_bytes": dec_bytes, "decode_flops": dec_flops, "prefill_bytes": pre_bytes,
            "prefill_flops": pre_flops}


# the groups of a step trace's decode steps (`decode_steps_vs_floor`): by batch size, (low, high) with None for no
# upper end; by the number of shared prefixes in the step (`decode_prefixes`), the last one open-ended
DECODE_BATCH_RANGES = ((1, 15), (16, 63), (64, 127), (128, 191), (192, None))
DECODE_PREFIX_COUNTS = ((0, 0), (1, 1), (2, 2), (3, None))


def decode_step_floor(row: dict, costs: dict, dev: DeviceFigures | dict) -> float:
    """The least device time (seconds) of one decode step of a step trace (its row: `decode_batch`, and the KV
    entries its attention read, `decode_ctx_tokens` and `decode_prefix_tokens`), as `floor` counts a decode step:
    every weight read once plus those entries, or 2 FLOPs per weight per token plus the attention's, whichever is
    longer."""
    d = dev.as_dict() if isinstance(dev, DeviceFigures) else dev
    nbytes, flops = _decode_work(1, row["decode_batch"], row["decode_ctx_tokens"] + row["decode_prefix_tokens"], costs)
    return max(nbytes / d["copy_bytes_per_s"], flops / d["matmul_flops_per_s"])


def decode_steps_vs_floor(rows: list[dict], costs: dict, dev: DeviceFigures | dict, by: str = "batch") -> list[dict]:
    """The decode steps of a step trace (Engine.trace rows with their device seconds and KV counts) against their
    floor, grouped by batch size (by="batch": DECODE_BATCH_RANGES) or by the number of shared prefixes the step's
    sequences start with (by="prefixes": DECODE_PREFIX_COUNTS), then all of them: per group the steps, the median
    batch, prefixes, own context per sequence and shared-prefix entries, the median step's device and floor
    milliseconds and the median of their ratios, and the group's seconds. The device seconds run from the step's
    first kernel to its sampled tokens: the forward, the signals and the sampling; the floor is the forward's alone.
    [] when the rows lack the counts (a trace from before them) or hold no timed decode step."""
    key, ranges = {"batch": ("decode_batch", DECODE_BATCH_RANGES),
                   "prefixes": ("decode_prefixes", DECODE_PREFIX_COUNTS)}[by]
    steps = [r for r in rows if r.get("decode_batch") and r.get("device_decode_s") is not None
             and "decode_ctx_tokens" in r and key in r]

    out = []
    for name, sel in _groups(steps, key, ranges):
        dev_s = [r["device_decode_s"] for r in sel]
        floor_s = [decode_step_floor(r, costs, dev) for r in sel]
        out.append({by: name, "steps": len(sel), "median_batch": _med([r["decode_batch"] for r in sel]),
                    "median_prefixes": _med([r["decode_prefixes"] for r in sel if "decode_prefixes" in r]),
                    "median_ctx_per_seq": _med([r["decode_ctx_tokens"] / r["decode_batch"] for r in sel]),
                    "median_prefix_entries": _med([r["decode_prefix_tokens"] for r in sel])} | _against(dev_s, floor_s))
    return out


def launch_by_batch(rows: list[dict]) -> list[dict]:
    """The host's launch of a step trace's decode steps (its `launch_s`: the engine step's first half, from building
    the inputs to the last launch; the device mostly waits meanwhile), grouped by batch size (DECODE_BATCH_RANGES),
    steps without a prefill apart from those with one: per group the steps, the median batch, the median launch
    and tracking milliseconds (`track_s`: dragin-streaming's attention maxima to the tracking kernel and back), the
    median share of the launch's wall the thread spent on its CPU (`launch_cpu_s`, its thread time: the rest it
    waited, for the GIL or in a blocking call), the median launch per decode sequence in microseconds, and the
    group's launch seconds. [] without timed decode steps."""
    steps = [r for r in rows if r.get("decode_batch") and "launch_s" in r]
    out = []
    for kind, sel0 in (("decode only", [r for r in steps if not r.get("prefill_seqs")]),
                       ("with a prefill", [r for r in steps if r.get("prefill_seqs")])):
        for name, sel in _groups(sel0, "decode_batch", DECODE_BATCH_RANGES):
            out.append({"steps": kind, "batch": name, "n": len(sel),
                        "median_batch": _med([r["decode_batch"] for r in sel]),
                        "median_launch_ms": 1e3 * _med([r["launch_s"] for r in sel]),
                        "median_track_ms": 1e3 * _med([r.get("track_s", 0.0) for r in sel])
                        if any("track_s" in r for r in sel) else None,
                        "median_launch_cpu_share": _med([r["launch_cpu_s"] / r["launch_s"] for r in sel
                                                         if "launch_cpu_s" in r and r["launch_s"] > 0]),
                        "median_launch_us_per_seq": 1e6 * _med([r["launch_s"] / r["decode_batch"] for r in sel]),
                        "launch_s": sum(r["launch_s"] for r in sel)})
    return out


def launch_fit(rows: list[dict]) -> dict | None:
    """A least-squares fit of a step trace's launch seconds over its steps that decoded, leaving out those whose
    prefill ran eagerly (a launch of hundreds of dispatches a forward, tens of ms, would swamp the rest): launch =
    fixed + per decode sequence x batch + per prefill sequence x prefilled sequences + per prefill token x tokens.
    Milliseconds (fixed) and microseconds (the rest); None with fewer steps than 8."""
    import numpy as np

    steps = [r for r in rows if r.get("decode_batch") and "launch_s" in r
             and not (r.get("prefill_seqs") and r.get("prefill_graphed") is False)]
    if len(steps) < 8:
        return None
    a = np.array([[1.0, r["decode_batch"], r.get("prefill_seqs", 0), r.get("prefill_tokens", 0)] for r in steps])
    y = np.array([r["launch_s"] for r in steps])
    c = np.linalg.lstsq(a, y, rcond=None)[0]
    return {"steps": len(steps), "fixed_ms": 1e3 * float(c[0]), "per_decode_seq_us": 1e6 * float(c[1]),
            "per_prefill_seq_us": 1e6 * float(c[2]), "per_prefill_token_us": 1e6 * float(c[3])}


def _med(xs):
    return statistics.median(xs) if xs else None


def _groups(steps: list[dict], key: str, ranges):
    """(name, steps) per range of row[key] that holds any (a range (lo, hi), hi None for no upper end, named "lo",
    "lo-hi" or "lo+"), then ("all", steps) when more than one range did."""
    n = 0
    for lo, hi in ranges:
        sel = [r for r in steps if r[key] >= lo and (hi is None or r[key] <= hi)]
        if sel:
            n += 1
            yield (str(lo) if lo == hi else f"{lo}-{hi}" if hi is not None else f"{lo}+"), sel
    if n > 1:
        yield "all", steps


def _against(dev_s: list[float], floor_s: list[float]) -> dict:
    """A group's device seconds against their floors: the median step's milliseconds and the median of the ratios,
    and the sums."""
    return {"median_device_ms": 1e3 * _med(dev_s), "median_floor_ms": 1e3 * _med(floor_s),
            "median_device_over_floor": _med([a / b for a, b in zip(dev_s, floor_s)]),
            "device_s": sum(dev_s), "floor_s": sum(floor_s), "device_over_floor": sum(dev_s) / sum(floor_s)}


# the groups of a step trace's prefill steps and attention passes (`forwards_vs_floor`) by the tokens the step put
# through them, (low, high) with None for no upper end
TOKEN_RANGES = ((1, 63), (64, 255), (256, 599), (600, 1023), (1024, None))

# per kind of forward, the step-trace fields (Engine.trace) of its tokens, forwards, attention entries, sequences,
# device seconds, and of whether it replayed a CUDA graph
FORWARD_FIELDS = {
    "prefill": ("prefill_tokens", "prefill_calls", "prefill_ctx_tokens", "prefill_seqs", "device_prefill_s",
                "prefill_graphed"),
    "passes": ("pass_tokens", "pass_calls", "pass_ctx_tokens", "pass_lists", "device_passes_s", "pass_graphed"),
}


def forward_floor(calls: int, tokens: int, ctx_entries: int, costs: dict, dev: DeviceFigures | dict) -> float:
    """The least device time (seconds) of `calls` prefill forwards (or DRAGIN attention passes) over `tokens` tokens
    whose attention covered `ctx_entries` (token, context entry) pairs, as `floor` counts prefill work: the weights
    read once per forward plus the tokens' KV written, or 2 FLOPs per weight per token (the LM head left out) plus
    the attention's, whichever is longer. (An attention pass stops at the last layer's queries and keys, so it skips
    about 1/layers of the weights: its floor here is high by at most that.)"""
    d = dev.as_dict() if isinstance(dev, DeviceFigures) else dev
    nbytes, flops = _forward_work(calls, tokens, ctx_entries, costs)
    return max(nbytes / d["copy_bytes_per_s"], flops / d["matmul_flops_per_s"])


def forwards_vs_floor(rows: list[dict], costs: dict, dev: DeviceFigures | dict, kind: str = "prefill") -> list[dict]:
    """The prefill steps (kind "prefill") or the attention passes (kind "passes": those the scheduler launched
    after each step, in that step's row) of a step trace against their floor (`forward_floor`), grouped by the
    tokens the step put through them (TOKEN_RANGES), then all of them: per group the steps, the median forwards,
    sequences and tokens a step, the steps whose forwards replayed CUDA graphs (prefill: the step's; passes: steps
    with any replayed pass forward), the median step's device and floor milliseconds and the median of their
    ratios, and the group's seconds. A prefill step's device seconds end at its first tokens sampled. [] when the
    rows lack the counts (a trace from before them) or hold no timed step of the kind."""
    tok, calls, ctx, seqs, dev_key, graphed = FORWARD_FIELDS[kind]
    steps = [r for r in rows if r.get(tok) and r.get(dev_key) is not None and calls in r and ctx in r]

    out = []
    for name, sel in _groups(steps, tok, TOKEN_RANGES):
        dev_s = [r[dev_key] for r in sel]
        floor_s = [forward_floor(r[calls], r[tok], r[ctx], costs, dev) for r in sel]
        out.append({"tokens": name, "steps": len(sel), "median_forwards": _med([r[calls] for r in sel]),
                    "median_seqs": _med([r.get(seqs, 0) for r in sel]), "median_tokens": _med([r[tok] for r in sel]),
                    "graphed_steps": sum(1 for r in sel if r.get(graphed))} | _against(dev_s, floor_s))
    return out


COUNTERS = ("decode_ctx_tokens", "decode_prefix_tokens", "prefill_ctx_tokens")


def missing_field(m: dict) -> str | None:
    """The first field a run's metrics.json lacks for its floor (runs from before the counters), else None."""
    if m.get("model_costs") is None:
        return "model_costs"
    st = m.get("engine") or {}
    return next((f"engine.{k}" for k in COUNTERS if k not in st), None)


def phases(m: dict, f: dict) -> dict:
    """A run's phase seconds beside their floors `f` (from `floor`), and what its engine did."""
    st, sec = m["engine"], m.get("step_seconds") or {}
    busy = device_busy(st)
    wall = (m.get("joint") or {}).get("wall_s", m.get("wall_s"))
    return {
        # the attention passes are prefill work in the counters; their seconds are the scheduler's; the shared
        # prefixes' prefill (set before the first step) is in the counters too
        "prefill_and_passes_s": st["prefill_s"] + st.get("prefix_prefill_s", 0.0) + sec.get("attention_passes", 0.0),
        "prefill_floor_s": f["prefill_s"], "prefill_bound": f["prefill_bound"],
        "decode_s": st["decode_s"], "decode_floor_s": f["decode_s"], "decode_bound": f["decode_bound"],
        "decode_steps": st["decode_steps"],
        "mean_decode_batch": st["decode_tokens"] / st["decode_steps"] if st["decode_steps"] else None,
        "methods_and_other_s": sec.get("methods_and_other"),
        # the scheduler's thread with nothing to do but wait for spaCy worker processes
        "waiting_text_workers_s": sec.get("waiting_text_workers"),
        "kv_waits": st.get("kv_waits"), "evictions": st.get("evictions"),
        # the most KV blocks held at once against the pool's size (None: a run from before the counter)
        "kv_peak_fraction": st["kv_peak_blocks"] / m["kv_cache_blocks"]
        if st.get("kv_peak_blocks") is not None and m.get("kv_cache_blocks") else None,
        # the device's own seconds in the steps' prefills, decode steps and attention passes (Engine.clock), and
        # their share of the wall time: the rest the device waited for the host (None: a run from before the clock)
        "device_busy_s": busy, "device_busy_fraction": busy / wall if busy is not None and wall else None}


DEVICE_KEYS = ("device_prefill_s", "device_decode_s", "device_passes_s")
STEP_TRACE_ENV = "FASTRAG_STEP_TRACE"  # 1: fastrag.eval writes the engine's per-step rows (step_trace.jsonl)


def trace_summary(rows: list[dict]) -> dict:
    """Where the steps' wall time went, from Engine.trace rows with the scheduler's additions (window_s, step_s: a
    step launched with overlap). Per step the device was busy for its device seconds (prefill + decode + the passes
    launched in it) and idle for the rest of the step's wall; idle seconds are split by what the step did."""
    def dev(r):
        return sum(r.get(k, 0.0) for k in DEVICE_KEYS)

    timed = [r for r in rows if "step_s" in r]
    out = {"steps": len(rows), "steps_timed": len(timed)}
    if not timed:
        return out
    idle = [max(0.0, r["step_s"] - dev(r)) for r in timed]
    walls = sorted(r["step_s"] for r in timed)
    decode = sorted(r["device_decode_s"] for r in timed if r.get("decode_batch") and "device_decode_s" in r)
    out |= {"step_s": sum(walls), "device_s": sum(dev(r) for r in timed), "idle_s": sum(idle),
            "idle_in_prefill_steps_s": sum(i for i, r in zip(idle, timed) if r.get("prefill_seqs")),
            "idle_in_steps_with_passes_s": sum(i for i, r in zip(idle, timed) if r.get("device_passes_s")),
            "steps_idle_over_half": sum(i > 0.5 * r["step_s"] for i, r in zip(idle, timed)),
            "median_step_ms": 1e3 * walls[len(walls) // 2],
            "median_device_decode_ms": 1e3 * decode[len(decode) // 2] if decode else None,
            "median_window_ms": 1e3 * sorted(r.get("window_s", 0.0) for r in timed)[len(timed) // 2]}
    # by what a step did: "decode" (decode only), "prefill", "passes" (DRAGIN's attention passes ran in its window),
    # "prefill+passes", and apart from those "graph_capture" (a CUDA graph was captured in it: tens of ms each)
    kinds: dict[str, dict] = {}
    for r, i in zip(timed, idle):
        if r.get("graph_captures"):
            k = "graph_capture"
        else:
            k = "+".join(n for n, on in (("prefill", r.get("prefill_seqs")), ("passes", r.get("device_passes_s")))
                         if on) or "decode"
        d = kinds.setdefault(k, {"steps": 0, "step_s": 0.0, "device_s": 0.0, "idle_s": 0.0, "_walls": []})
        d["steps"] += 1
        d["step_s"] += r["step_s"]
        d["device_s"] += dev(r)
        d["idle_s"] += i
        d["_walls"].append(r["step_s"])
    for d in kinds.values():
        w = sorted(d.pop("_walls"))
        d["median_step_ms"] = 1e3 * w[len(w) // 2]
    out["by_kind"] = kinds
    out["graph_captures"] = sum(r.get("graph_captures", 0) for r in rows)
    # the steps in which Triton compiled a kernel (fastrag.kernels.compiles), the first 20 with their wall
    comp = [r for r in rows if r.get("compiles")]
    out["triton_compiles"] = sum(len(r["compiles"]) for r in comp)
    out["steps_with_compiles"] = [{"step": r.get("step"), "kernels": list(r["compiles"]),
                                   "step_ms": 1e3 * r["step_s"] if "step_s" in r else None} for r in comp[:20]]
    # the prefill steps replayed from a prefill graph and the eager ones (rows that say: graphs on), apart
    pre = [r for r in timed if r.get("prefill_seqs") and "prefill_graphed" in r and "device_prefill_s" in r]
    for name, on in (("prefill_graphed", True), ("prefill_eager", False)):
        sel = [r for r in pre if r["prefill_graphed"] == on]
        if pre:
            out[name] = {"steps": len(sel), "device_s": sum(r["device_prefill_s"] for r in sel),
                         "median_tokens": statistics.median(r["prefill_tokens"] for r in sel) if sel else None,
                         "median_device_ms": 1e3 * statistics.median(r["device_prefill_s"] for r in sel)
                         if sel else None}
    # the run's tail: steps that decoded fewer than 16 sequences (the weights read for a handful of tokens)
    small = [r for r in timed if 0 < r.get("decode_batch", 0) < 16]
    out["steps_under_16_sequences"] = len(small)
    out["step_s_under_16_sequences"] = sum(r["step_s"] for r in small)
    return out


def device_busy(st: dict) -> float | None:
    """Device seconds of an engine's counted phases (Engine.stats), None when it has no device clock."""
    if not all(k in st for k in DEVICE_KEYS):
        return None
    return sum(st[k] for k in DEVICE_KEYS) + st.get("prefix_prefill_s", 0.0)


def report(run_dirs: list[str], figures: DeviceFigures) -> list[dict]:
    """Per run directory (its metrics.json from `fastrag run`): wall and phase seconds against the floor."""
    import json
    from pathlib import Path

    def load(path: Path) -> dict:
        if not path.exists():
            raise FileNotFoundError(f"{path}: no metrics.json (a run directory of `fastrag run` holds one)")
        try:
            m = json.loads(path.read_text())
        except ValueError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
        if not isinstance(m, dict):
            raise ValueError(f"{path}: expected a JSON object, found {type(m).__name__}")
        return m

    rows = []
    for d in run_dirs:
        path = Path(d) / "metrics.json"
        m = load(path)
        runs = [("", path, m)]
        if "ray" in m and "engine" not in m:
            # a --ray run: each shard's engine counted its own work, in its own folder; the run names its shards
            # (a folder an earlier run with more workers left is not one of them)
            named = (m.get("ray") or {}).get("shards")
            found = (Path(d) / "shards" / s / "metrics.json" for s in named) if named else \
                (Path(d) / "shards").glob("*/metrics.json")
            shards = sorted((p for p in found if p.exists()), key=lambda p: (len(p.parent.name), p.parent.name))
            if not shards:
                raise ValueError(f"{path}: a --ray run, whose engine figures are in its shards' folders, and "
                                 f"{Path(d) / 'shards'} holds no shard's metrics.json")
            runs = [(f" shards/{p.parent.name}", p, load(p)) for p in shards]
        for label, p, m in runs:
            miss = missing_field(m)
            if miss is not None:
                raise ValueError(f"{p}: field {miss} is missing (written by fastrag runs since the device floor "
                                 "was added; rerun it)")
            f = floor(m["engine"], m["model_costs"], figures)
            wall = (m.get("joint") or {}).get("wall_s", m["wall_s"])
            # (questions of the run that measured these figures: a rerun that computed nothing carries them over;
            # a run that did no model work, all its questions failed at once, has no floor to compare with)
            rows.append({"run": f"{m['method']}/{m['dataset']}{label}",
                         "questions": m.get("questions_measured", m.get("computed_this_run")),
                         "wall_s": wall, "floor_s": f["total_s"],
                         "wall_over_floor": wall / f["total_s"] if f["total_s"] > 0 else None}
                        | phases(m, f))
    return rows


def main(argv: list[str] | None = None) -> None:
    import argparse
    import datetime as dt
    import sys
    from pathlib import Path

    ap = argparse.ArgumentParser(description="Engine runs against the device floor of their model work "
                                             "(figures measured on this machine now: run it where the runs ran)")
    ap.add_argument("runs", nargs="+", help="run directories of `fastrag run` (each holds metrics.json)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="matmul dtype of the rate (default: bfloat16 on a GPU, float32 on a CPU)")
    ap.add_argument("--output", default=None, help="also write the table to this markdown file")
    args = ap.parse_args(argv)
    if args.output and not Path(args.output).resolve().parent.is_dir():
        sys.exit(f"fastrag.perf: error: --output {args.output}: its folder does not exist")
    gpu = torch.cuda.is_available()
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if gpu else torch.float32)
    figures = measure_device("cuda" if gpu else "cpu", dtype)
    try:
        rows = report(args.runs, figures)
    except (ValueError, OSError) as e:
        sys.exit(f"fastrag.perf: error: {e}")
    cols = list(rows[0])
    text = (f"- date: {dt.date.today().isoformat()}\n- device: {figures.device}, torch {torch.__version__}\n"
            f"- measured: copy {figures.copy_bytes_per_s / 1e9:.1f} GB/s (read + write), {figures.dtype} matmul "
            f"{figures.matmul_flops_per_s / 1e9:.1f} GFLOP/s\n"
            f"- command: `python -m fastrag.perf {' '.join(sys.argv[1:] if argv is None else argv)}`\n\n"
            "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n")
    for r in rows:
        text += "| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()) + " |\n"
    print(text)
    if args.output:
        try:
            Path(args.output).write_text(text)
        except OSError as e:
            sys.exit(f"fastrag.perf: error: --output {args.output}: {e.strerror}")


if __name__ == "__main__":
    main()

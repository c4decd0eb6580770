"""Experiment `hybrid`: a Qwen3.5-style hybrid model end to end (seed 002 at the model level).

The model is refimpl.qwen35 (GDN layers with their conv and recurrent states, gated full attention
with its KV cache). The GDN op comes from the backend: refimpl (numpy) or native (kernels/ in C
through ctypes, on this host), in its serial and chunkwise forms. Everything runs here, on the host.

oracle     per GDN form: chunk prefill with past against redecode (token at the position, NMSE of
           every carried state) and against the float64 model written out independently
           (refimpl.naive_qwen35: NMSE of the logits, token), the padded tail against the scalar tail (first token, state), and
           pad rows as the identity on the GDN state (bit-exact, for the forms whose arithmetic
           allows it: see tests/test_hybrid_oracles.py). On the `shape` model.
crossover  prefill tokens/s of a prompt of L tokens (prefill_chunk rows per call) for each L of
           bench.contexts: the dense model (every layer full attention, same width and depth), the
           hybrid with serial GDN, with chunkwise GDN, and with no recurrence at all (the GDN's share
           of the time, hence the most a faster GDN can gain), all interleaved. The crossover context
           is where the hybrid overtakes the dense model, from a fit of seconds per token = a + b L
           for each (the seed's ~24-28k is such an extrapolation from 512..8k). L = 512 gives pp512
           serial vs chunkwise (the seed's 93 -> 150 goal is 1.6x). On the `bench.shape` model.
tail       padded vs scalar tail (prompt = chunk + t for each t of bench.tails), interleaved:
           does padding pay now that the state allows it, and from which tail (breakeven).
Timings alternate between the variants and are taken on both clocks; the tables read the CPU-time
rates (tokens per CPU second), since this host is shared and its wall times swing with other load.

drift      the chunkwise GDN's products in fp16 with f32 or fp16 accumulation (an NPU matrix unit)
           against f32: NMSE of the logits at every position and of the final states, and the share
           of positions whose argmax agrees, over prompts of bench.drift_tokens.
bench      crossover + tail + drift; all = oracle + bench.

`testbed sweep experiment=hybrid mode=crossover gdn_chunk=16,32,64,128` sweeps the GDN chunk;
`... bench.contexts=512,2048,8192` sweeps the context (the crossover then appears under the sweep).
"""

from __future__ import annotations

from functools import partial
from typing import Iterator

import numpy as np
import pandas as pd
from omegaconf import DictConfig

from refimpl import gdn, qwen35
from testbed import breakeven
from testbed.config import Choice, Float, Int, IntList, as_list
from testbed.errors import UsageError
from testbed.hybrid_oracles import check_chunk_with_past, check_pad_identity, check_padded_tail
from testbed.measure import time_alternating_clocks
from testbed.oracles import nmse
from testbed.results import Record

MODES = ("oracle", "crossover", "tail", "drift", "bench", "all")
PARTS = {"oracle": ("oracle",), "crossover": ("crossover",), "tail": ("tail",), "drift": ("drift",),
         "bench": ("crossover", "tail", "drift"), "all": ("oracle", "crossover", "tail", "drift")}
MODELS = ("dense", "hybrid-serial", "hybrid-chunkwise", "hybrid-no-recurrence")
# The seed's figures (26/05, phone NPU, Qwen3.5 hybrid vs a dense model): prefill tokens/s.
SEED = {"hybrid": {512: 93, 2048: 97, 8192: 91}, "dense": {512: 285, 8192: 182}, "crossover": "~24-28k",
        "pp512_goal": 150 / 93}

SHAPE_KEYS = ("vocab", "hidden", "layers", "mlp", "heads", "kv_heads", "head_dim", "linear_k_heads",
              "linear_v_heads", "linear_head_dim", "conv_kernel")
PARAMS = {
    "backend": Choice(("refimpl", "native")),
    "mode": Choice(MODES),
    "chunk": Int(1, 4096),
    "gdn_chunk": Int(1, 4096),
    "threads": Int(1, 256),
    "threshold": Float(0.0, 1.0),
    "seed": Int(0),
    **{f"shape.{k}": Int(1) for k in SHAPE_KEYS},
    **{f"bench.shape.{k}": Int(1) for k in SHAPE_KEYS},
    "oracle.prompt_tokens": Int(2, 1 << 16),
    "oracle.past": IntList(0, 1 << 16),
    "oracle.tokens": IntList(1, 4096),
    "oracle.tails": IntList(1, 4095),
    "bench.contexts": IntList(1, 1 << 17),
    "bench.prefill_chunk": Int(1, 1 << 16),
    "bench.tails": IntList(0, 4095),
    "bench.drift_tokens": IntList(1, 1 << 16),
    "bench.reps": Int(1, 1000),
    "bench.warmup": Int(0, 100),
}


def validate(cfg: DictConfig) -> None:
    """The native GDN is the host's ctypes library: it computes here, so the device must be this host.
    What the mode runs must fit: oracle cases P + n within the prompt and n within one chunk, tails
    shorter than a chunk."""
    if cfg.backend == "native" and (cfg.device.get("transport") != "local" or cfg.device.get("abi") != "host"):
        raise UsageError(f"backend=native runs the GDN kernels through ctypes on this host; device={cfg.device.name} "
                         f"is not the host (accepted: device=host, or backend=refimpl)")
    parts = PARTS[cfg.mode]
    tails = []
    if "oracle" in parts:
        past, tokens = as_list(cfg.oracle.past), as_list(cfg.oracle.tokens)
        if len(past) != len(tokens):
            raise UsageError(f"oracle.past has {len(past)} entries and oracle.tokens {len(tokens)}; "
                             f"accepted: one n per P")
        for p, n in zip(past, tokens):
            if n > cfg.chunk or p + n > cfg.oracle.prompt_tokens:
                raise UsageError(f"oracle case P={p}, n={n} does not fit chunk={cfg.chunk} and oracle.prompt_tokens="
                                 f"{cfg.oracle.prompt_tokens}; accepted: n <= chunk, P + n <= prompt")
        tails += as_list(cfg.oracle.tails)
    if "tail" in parts:
        tails += as_list(cfg.bench.tails)
    bad = [t for t in tails if t >= cfg.chunk]
    if bad:
        raise UsageError(f"tail {bad[0]} is not shorter than chunk={cfg.chunk}; accepted: tails 0..{cfg.chunk - 1}")


def model_config(shape: DictConfig) -> qwen35.HybridConfig:
    try:
        return qwen35.HybridConfig(**{k: int(shape[k]) for k in SHAPE_KEYS})
    except ValueError as e:
        raise UsageError(f"shape: {e}") from None


def no_recurrence(q, k, v, g, beta, state, head_map):
    """A GDN op that does no work (zero output, state unchanged): the hybrid timed with it is
    everything but the recurrence, so 1 - its time / the serial hybrid's is the recurrence's share,
    and 1 / (1 - share) the most any faster GDN form can gain on this model (Amdahl)."""
    return np.zeros_like(v), state


def gdn_forms(cfg: DictConfig) -> dict[str, qwen35.GDNFn]:
    """The backend's serial and chunkwise GDN, as the model calls them."""
    if cfg.backend == "native":
        from testbed.backends.native import library as native

        return {"serial": partial(native.gdn_serial, threads=cfg.threads),
                "chunkwise": partial(native.gdn_chunkwise, chunk=cfg.gdn_chunk, threads=cfg.threads)}
    return {"serial": qwen35.gdn_form("serial"), "chunkwise": qwen35.gdn_form("chunkwise", cfg.gdn_chunk)}


def artifacts(cfg: DictConfig) -> dict:
    if cfg.backend == "native":
        from testbed.backends.native import library as native

        return native.build_info()
    return {}


# --- oracle ------------------------------------------------------------------------------------------


def oracle_records(cfg: DictConfig, ctx) -> Iterator[Record]:
    model = model_config(cfg.shape)
    w = qwen35.init_weights(model, cfg.seed)
    prompt = np.random.default_rng(cfg.seed).integers(0, model.vocab, cfg.oracle.prompt_tokens)
    arts = artifacts(cfg)

    def record(case, v, params):
        return Record("hybrid", case, "oracle", v.oracle, v.verdict, v.margin, v.metrics, params=params,
                      artifacts=arts, detail=v.detail)

    for form, fn in gdn_forms(cfg).items():
        base = {"gdn": form, "gdn_chunk": cfg.gdn_chunk if form == "chunkwise" else None, "chunk": cfg.chunk}
        for p, n in zip(as_list(cfg.oracle.past), as_list(cfg.oracle.tokens)):
            ctx.progress(f"hybrid oracle {form} P={p} n={n}")
            for v in check_chunk_with_past(w, model, prompt, p, n, cfg.chunk, fn, cfg.threshold):
                yield record(f"P={p},n={n},C={cfg.chunk}/{form}", v, base | {"past": p, "tokens": n})
        for t in as_list(cfg.oracle.tails):
            length = cfg.chunk + t
            ctx.progress(f"hybrid oracle {form} padded tail N={length}")
            for v in check_padded_tail(w, model, prompt[:length], cfg.chunk, fn, cfg.threshold):
                yield record(f"N={length},tail={t},C={cfg.chunk}/{form}", v,
                             base | {"prompt_tokens": length, "tail": t})
        # numpy's chunkwise products reblock with the row count, so only its serial form is bit-exact
        if cfg.backend == "native" or form == "serial":
            x = gdn.draw_inputs(1, 37, model.linear_k_heads, model.linear_head_dim,
                                v_repeat=model.linear_v_heads // model.linear_k_heads, gate="mild", seed=cfg.seed)
            yield record(f"pads=27/{form}", check_pad_identity(x, 27, fn), base | {"pads": 27})


# --- measurements ------------------------------------------------------------------------------------


def figures(clocks: dict, tokens: int, flops: int) -> dict:
    """Wall and CPU time, and the rates per each: on a shared machine the CPU figures are what the
    work cost, the wall figures what a user waited."""
    wall, cpu = clocks["wall"], clocks["cpu"]
    return {"time": wall.scaled(1e3, "ms"), "tokens_per_s": wall.rate(tokens, "tokens/s"),
            "cpu_time": cpu.scaled(1e3, "ms"), "tokens_per_cpu_s": cpu.rate(tokens, "tokens/s"),
            "gflops_cpu": cpu.rate(flops / 1e9, "GFLOP/s")}


def crossover_records(cfg: DictConfig, ctx) -> Iterator[Record]:
    b = cfg.bench
    hybrid = model_config(b.shape)
    dense = qwen35.dense_config(hybrid)
    w_h, w_d = qwen35.init_weights(hybrid, cfg.seed), qwen35.init_weights(dense, cfg.seed)
    forms = gdn_forms(cfg)
    runs = {"dense": (dense, w_d, forms["serial"]),  # no GDN layer: the form is never called
            "hybrid-serial": (hybrid, w_h, forms["serial"]),
            "hybrid-chunkwise": (hybrid, w_h, forms["chunkwise"]),
            "hybrid-no-recurrence": (hybrid, w_h, no_recurrence)}
    arts = artifacts(cfg)
    for length in as_list(b.contexts):
        ctx.progress(f"hybrid crossover L={length}")
        prompt = np.random.default_rng(cfg.seed).integers(0, hybrid.vocab, length)
        times = time_alternating_clocks({name: partial(qwen35.prefill, w, m, prompt, b.prefill_chunk, fn)
                                         for name, (m, w, fn) in runs.items()}, reps=b.reps, warmup=b.warmup)
        cpu = {name: t["cpu"].median for name, t in times.items()}
        for name, (m, _, _) in runs.items():
            flops = qwen35.prefill_flops(m, length, b.prefill_chunk)
            yield Record(
                "hybrid", f"L={length}/{name}", "measure",
                figures=figures(times[name], length, flops),
                metrics={"x_dense_cpu": cpu["dense"] / cpu[name], "x_serial_cpu": cpu["hybrid-serial"] / cpu[name]},
                work={"flops": flops, "flop_count": "qwen35.prefill_flops (GDN: gdn_flops, the serial count)",
                      "tokens": length},
                params={"part": "crossover", "context": length, "model": name, "prefill_chunk": b.prefill_chunk,
                        "gdn_chunk": cfg.gdn_chunk, "threads": cfg.threads,
                        "layer_types": "".join(t[0] for t in m.layer_types)},
                artifacts=arts)


def tail_records(cfg: DictConfig, ctx) -> Iterator[Record]:
    """Padded vs scalar tail after one full chunk, chunkwise GDN, interleaved over every (N, mode)."""
    b = cfg.bench
    model = model_config(b.shape)
    w = qwen35.init_weights(model, cfg.seed)
    fn = gdn_forms(cfg)["chunkwise"]
    prompt = np.random.default_rng(cfg.seed).integers(0, model.vocab, 2 * cfg.chunk)
    lengths = [cfg.chunk + t for t in as_list(b.tails)]
    ctx.progress(f"hybrid tail N={lengths}")
    calls = {(n, mode): partial(qwen35.prefill, w, model, prompt[:n], cfg.chunk, fn, mode)
             for n in lengths for mode in ("padded", "scalar")}
    times = time_alternating_clocks(calls, reps=b.reps, warmup=b.warmup)
    arts = artifacts(cfg)
    for (n, mode), clocks in times.items():
        tail = n - cfg.chunk
        flops = qwen35.graph_flops(model, cfg.chunk, 0)  # the full chunk
        if tail and mode == "padded":
            flops += qwen35.graph_flops(model, cfg.chunk, cfg.chunk)
        elif tail:
            flops += sum(qwen35.graph_flops(model, 1, cfg.chunk + i) for i in range(tail))
        # the prefill's time is the time to the first token's logits (TTFT)
        yield Record("hybrid", f"N={n}/{mode}", "measure", figures=figures(clocks, n, flops),
                     work={"flops": flops, "tokens": n},
                     params={"part": "tail", "prompt_tokens": n, "tail": tail, "mode": mode, "chunk": cfg.chunk,
                             "gdn_chunk": cfg.gdn_chunk, "threads": cfg.threads},
                     artifacts=arts)


def drift_records(cfg: DictConfig, ctx) -> Iterator[Record]:
    """fp16 products in the chunkwise GDN (refimpl's emulation, whatever the backend) against f32."""
    b = cfg.bench
    model = model_config(b.shape)
    w = qwen35.init_weights(model, cfg.seed)
    for length in as_list(b.drift_tokens):
        prompt = np.random.default_rng(cfg.seed).integers(0, model.vocab, length)
        ctx.progress(f"hybrid drift T={length} f32")
        ref_logits, ref_state = qwen35.redecode(w, model, prompt, partial(gdn.gdn_chunkwise, chunk=cfg.gdn_chunk))
        ref_tokens = ref_logits.argmax(axis=-1)
        for precision in ("fp16-acc32", "fp16-acc16"):
            ctx.progress(f"hybrid drift T={length} {precision}")
            fn = partial(gdn.gdn_chunkwise, chunk=cfg.gdn_chunk, precision=precision)
            logits, state = qwen35.redecode(w, model, prompt, fn)
            ref_arrays, arrays = ref_state.arrays(), state.arrays()
            recurrent = [k for k in ref_arrays if k.endswith("recurrent")]
            yield Record("hybrid", f"T={length}/{precision}", "measure",
                         metrics={"nmse_logits": nmse(ref_logits, logits),
                                  "nmse_recurrent": max(nmse(ref_arrays[k], arrays[k]) for k in recurrent),
                                  "token_agreement": float(np.mean(logits.argmax(axis=-1) == ref_tokens)),
                                  "last_token_agrees": bool(logits[-1].argmax() == ref_tokens[-1])},
                         work={"tokens": length},
                         params={"part": "drift", "tokens": length, "precision": precision,
                                 "gdn_chunk": cfg.gdn_chunk, "gdn_backend": "refimpl"})


def run(cfg: DictConfig, ctx) -> Iterator[Record]:
    from threadpoolctl import threadpool_limits

    parts = {"oracle": oracle_records, "crossover": crossover_records, "tail": tail_records, "drift": drift_records}
    with threadpool_limits(limits=cfg.threads):
        for part in PARTS[cfg.mode]:
            yield from parts[part](cfg, ctx)


# --- tables ------------------------------------------------------------------------------------------


def fit_per_token(contexts, seconds) -> tuple[float, float] | None:
    """Least-squares (a, b) of seconds per token = a + b L (attention's average cost grows with L)."""
    if len(set(contexts)) < 2:
        return None
    b, a = np.polyfit(np.asarray(contexts, float), np.asarray(seconds, float) / np.asarray(contexts, float), 1)
    return float(a), float(b)


def crossover_context(frame: pd.DataFrame, hybrid: str) -> dict:
    """Where `hybrid` overtakes dense: the first measured L with more tokens/s, and the fitted L
    (an extrapolation beyond the largest measured L, as the seed's)."""
    tps = frame.pivot_table(index="context", columns="model", values="tokens/s")
    if not {"dense", hybrid} <= set(tps.columns):
        return {}
    measured = [int(L) for L, r in tps.iterrows() if r[hybrid] >= r["dense"]]
    fits = {m: fit_per_token(tps.index, tps.index / tps[m]) for m in ("dense", hybrid)}
    fitted = None
    if fits["dense"] and fits[hybrid]:
        (a_d, b_d), (a_h, b_h) = fits["dense"], fits[hybrid]
        if b_d > b_h:
            fitted = max(0.0, (a_h - a_d) / (b_d - b_h))
    return {"first measured L where faster": measured[0] if measured else None,
            "fitted crossover L": None if fitted is None else int(round(fitted))}


def measure_frame(df: pd.DataFrame, part: str) -> pd.DataFrame:
    if df.empty or "params.part" not in df:
        return pd.DataFrame()
    m = df[(df["kind"] == "measure") & (df["params.part"] == part)]
    return m.sort_values("time", kind="stable") if "time" in m else m


def crossover_table(df: pd.DataFrame) -> pd.DataFrame:
    """tokens per CPU second per context and model (latest record of each; the wall figures are in the
    records), beside the seed's figures."""
    m = measure_frame(df, "crossover")
    if m.empty:
        return pd.DataFrame()
    m = m.groupby(["device", "backend", "params.context", "params.model"]).tail(1)
    rows = pd.DataFrame({"device": m["device"], "backend": m["backend"], "context": m["params.context"].astype(int),
                         "model": m["params.model"], "tokens/s": m["figures.tokens_per_cpu_s.median"].astype(float)})
    wide = rows.pivot_table(index=["device", "backend", "context"], columns="model", values="tokens/s").reset_index()
    wide = wide[["device", "backend", "context", *(m for m in MODELS if m in wide)]]  # MODELS' order
    wide.columns.name = None
    wide.insert(3, "tokens/s per", "CPU s")
    for model in MODELS:
        if model in wide:
            wide[model] = wide[model].round(1)
    if {"hybrid-serial", "hybrid-chunkwise"} <= set(wide.columns):
        wide["chunkwise x serial"] = (wide["hybrid-chunkwise"] / wide["hybrid-serial"]).round(2)
    if {"hybrid-serial", "hybrid-no-recurrence"} <= set(wide.columns):
        # the serial recurrence's share of the hybrid's time, and the bound it puts on any GDN speed-up
        share = 1 - wide["hybrid-serial"] / wide["hybrid-no-recurrence"]
        wide["GDN share"] = share.round(3)
        wide["bound x serial"] = (1 / (1 - share)).round(2)
    # object columns: whole numbers print whole beside the blanks of lengths the seed did not measure
    wide["seed hybrid"] = pd.Series([SEED["hybrid"].get(L) for L in wide["context"]], dtype=object)
    wide["seed dense"] = pd.Series([SEED["dense"].get(L) for L in wide["context"]], dtype=object)
    return wide


def crossover_summary(df: pd.DataFrame) -> pd.DataFrame:
    m = measure_frame(df, "crossover")
    if m.empty:
        return pd.DataFrame()
    rows = []
    for (device, backend), grp in m.groupby(["device", "backend"]):
        grp = grp.groupby(["params.context", "params.model"]).tail(1)
        frame = pd.DataFrame({"context": grp["params.context"].astype(int), "model": grp["params.model"],
                              "tokens/s": grp["figures.tokens_per_cpu_s.median"].astype(float)})
        for hybrid in ("hybrid-serial", "hybrid-chunkwise"):
            rows.append({"device": device, "backend": backend, "hybrid": hybrid,
                         **crossover_context(frame, hybrid), "seed": SEED["crossover"]})
    return pd.DataFrame(rows, dtype=object)


def tail_frame(df: pd.DataFrame) -> pd.DataFrame:
    """breakeven's columns from CPU-time figures (tok/s and TTFT per CPU second)."""
    m = measure_frame(df, "tail")
    if m.empty:
        return pd.DataFrame()
    m = m.groupby(["params.prompt_tokens", "params.mode"]).tail(1)
    wide = m.pivot_table(index=["params.prompt_tokens", "params.tail"], columns="params.mode",
                         values=["figures.tokens_per_cpu_s.median", "figures.cpu_time.median"], aggfunc="last").dropna()
    return pd.DataFrame({
        "prompt_tokens": wide.index.get_level_values(0).astype(int), "tail": wide.index.get_level_values(1).astype(int),
        "padded_tps": wide[("figures.tokens_per_cpu_s.median", "padded")].to_numpy(),
        "scalar_tps": wide[("figures.tokens_per_cpu_s.median", "scalar")].to_numpy(),
        "padded_ttft_ms": wide[("figures.cpu_time.median", "padded")].to_numpy(),
        "scalar_ttft_ms": wide[("figures.cpu_time.median", "scalar")].to_numpy()})


def tail_table(df: pd.DataFrame) -> pd.DataFrame:
    sweep = tail_frame(df)
    if sweep.empty:
        return sweep
    table = breakeven.tail_table(sweep).astype(object)
    b = breakeven.breakeven_tail(sweep)
    verdict = f"padded from tail {b}" if b is not None else f"scalar up to tail {int(sweep['tail'].max())}"
    return pd.concat([table, pd.DataFrame([{"N": "breakeven", "winner": verdict}], dtype=object)], ignore_index=True)


def drift_table(df: pd.DataFrame) -> pd.DataFrame:
    m = measure_frame(df, "drift")
    if m.empty:
        return pd.DataFrame()
    m = m.groupby(["params.tokens", "params.precision"]).tail(1)
    return pd.DataFrame({"tokens": m["params.tokens"].astype(int), "precision": m["params.precision"],
                         "NMSE logits": m["metrics.nmse_logits"], "NMSE recurrent": m["metrics.nmse_recurrent"],
                         "token agreement": m["metrics.token_agreement"].round(4),
                         "last token agrees": m["metrics.last_token_agrees"]}).reset_index(drop=True)


def oracle_table(df: pd.DataFrame) -> pd.DataFrame:
    o = df[df["kind"] == "oracle"] if len(df) else df
    if o.empty:
        return pd.DataFrame()
    return pd.DataFrame({"case": o["case"], "oracle": o["oracle"], "verdict": o["verdict"], "margin": o["margin"],
                         "nmse": o.get("metrics.nmse"), "bitexact": o.get("metrics.bitexact"),
                         "detail": o["detail"]}).reset_index(drop=True)


def summary(df: pd.DataFrame) -> list[pd.DataFrame]:
    """What `testbed run hybrid` prints: the oracle verdicts, the crossover table and its crossover
    contexts, the tail breakeven table, the fp16 drift."""
    tables = (oracle_table(df), crossover_table(df), crossover_summary(df), tail_table(df), drift_table(df))
    return [t for t in tables if len(t)]


def view(df: pd.DataFrame) -> pd.DataFrame:
    """`testbed table hybrid`: the crossover table from stored records (else the first table there is)."""
    tables = summary(df)
    crossover = crossover_table(df)
    return crossover if len(crossover) else (tables[0] if tables else pd.DataFrame())


def sweep_row(df: pd.DataFrame) -> dict:
    """Per sweep job: the oracle tally, tokens/s per model and context, chunkwise x serial (at L = 512:
    pp512) and the bound on it."""
    row: dict = {}
    o = df[df["kind"] == "oracle"]
    if len(o):
        row["oracles"] = f"{int((o['verdict'] == 'pass').sum())}/{len(o)} pass"
    table = crossover_table(df)
    for _, r in table.iterrows():
        for model in MODELS:
            if model in r:
                row[f"L={r['context']} {model}"] = r[model]
        for ratio in ("chunkwise x serial", "bound x serial"):
            if ratio in r:
                row[f"L={r['context']} {ratio}"] = r[ratio]
    return row


def sweep_footer(rows: pd.DataFrame, jobs) -> str:
    """A sweep over bench.contexts: the crossover over its jobs (one context each)."""
    cols = [c for c in rows.columns if c.startswith("L=") and c.split(" ", 1)[1] in MODELS]
    if len({c.split(" ")[0] for c in cols}) < 2:
        return ""  # a crossover needs two contexts at least
    long = pd.DataFrame([{"context": int(c.split(" ")[0][2:]), "model": c.split(" ", 1)[1], "tokens/s": v}
                         for _, r in rows.iterrows() for c in cols if pd.notna(r[c]) for v in [r[c]]])
    parts = [f"{h}: {crossover_context(long.groupby(['context', 'model'], as_index=False).last(), h)}"
             for h in ("hybrid-serial", "hybrid-chunkwise")]
    return "crossover with dense: " + "; ".join(parts)

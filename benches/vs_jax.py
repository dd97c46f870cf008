#!/usr/bin/env python3
"""The table of benches/vs_jax.sh: dfc against the JAX peer, ratios and bars; all as JSON.

Reads what vs_jax.sh left in --work:
  round1/, round2/, …                            one directory per alternating round, holding
    dfc_{logreg,mlp,cnn}_{train,inference,batch1}.json
                                                 one `dfc bench --json` object each (batch1:
                                                 inference of the model compiled at batch 1)
    jax.json                                     bench_jax.py --out
    jax_batch1.json                              jax_batch1.py --out
  compile_ms.txt                                 5 wall times of `dfc compile examples/mlp.df`, in µs
  fma.txt                                        fma_peak's output (two runs)
  busy_before.txt                                CPUs busy with other work just before timing
  roundN/stat_{dfc,jax}.txt                      the `cpu` line of /proc/stat before and after each
                                                 side of the round (optional): the share of CPU
                                                 time the hypervisor stole while it ran
  roundN/round_trip_{dfc,jax}.txt                the round trip between CPUs 0 and 1 in ns, before
                                                 and after each side (optional)

Each round pairs dfc's figures with the peer's taken right after: a row's ratio is the median
of its rounds' ratios, and its times the medians of the rounds' medians (with one round, that
round's). Standard library only.
"""
import argparse
import json
import os
import platform
import re
import statistics
import sys

MODELS = ("logreg", "mlp", "cnn")
MODES = ("train", "inference", "batch1")
# dfc median / JAX median, at most (issue 25): each mode's bars, by model.
BARS = {
    "train": {"logreg": 0.5, "mlp": 0.7, "cnn": 0.5},
    "inference": {"mlp": 0.8, "cnn": 0.8},
    "batch1": {"logreg": 0.8, "mlp": 0.8, "cnn": 0.8},
}
# The mlp training step's FLOP rate, by the peer's count, as a share of the FMA peak: at least.
PEAK_BAR = 0.75
# A side of a round that lost more than this share of the CPUs' time to the hypervisor gets a note.
STOLEN_NOTE = 0.02
# A round trip between the CPUs longer than this (ns) gets a note: 55–100 ns where they share a cache here,
# 260–390 in the slow spells.
FAR_ROUND_TRIP_NS = 200
# The peer's count (common.py): 3 × the forward matmuls, 784-256-256-10, batch 128.
MLP_TRAIN_FLOPS = 3 * 2 * 128 * (784 * 256 + 256 * 256 + 256 * 10)
# vs_jax.sh --isa: the widest vectors each limit leaves both sides, in bits (native: whatever the CPU has).
ISA_WIDEST = {"native": 512, "avx2": 256}
JAX_ROW = {
    "train": "jax {} train step (per call)",
    "inference": "jax {} inference fwd (per call)",
    "batch1": "jax {} inference fwd batch 1 (per call)",
}


def fail(message):
    print(f"vs_jax.py: {message}", file=sys.stderr)
    sys.exit(1)


def load_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        fail(f"cannot read {path}: {e}")


def fma_peak(path, widest):
    """GFLOP/s of the best line on the most threads, of any width up to `widest` bits (Zen 4 runs its
    512-bit FMAs as two 256-bit halves: its 256-bit loop is as fast, and either may be the one a spell
    slowed; under --isa avx2 the 512-bit lines, if any, are not a peak the run could reach).
    fma_peak ran more than once: the best of each line, since other load can only slow it."""
    with open(path) as f:
        text = f.read()
    found = {}
    for bits, threads, gflops in re.findall(r"(\d+)-bit FMA, (\d+) thread\(s\): ([\d.]+) GFLOP/s", text):
        key = (int(bits), int(threads))
        found[key] = max(found.get(key, 0.0), float(gflops))
    reachable = {k: g for k, g in found.items() if k[0] <= widest}
    if not reachable:
        fail(f"no FMA figures of {widest} bits or fewer in {path}:\n{text}")
    most = max(t for _, t in reachable)
    best = max((k for k in reachable if k[1] == most), key=reachable.get)
    return reachable[best], f"{best[0]}-bit, {best[1]} thread(s)", found


def stolen_share(path):
    """The share of all CPU time the hypervisor stole between the two `cpu` lines of /proc/stat in
    `path` (user nice system idle iowait irq softirq steal …), or None without them."""
    try:
        with open(path) as f:
            lines = [line.split() for line in f if line.startswith("cpu ")]
    except OSError:
        return None
    if len(lines) != 2:
        return None
    try:
        before, after = ([int(x) for x in line[1:9]] for line in lines)
    except ValueError as e:
        fail(f"{path}: not a `cpu` line of /proc/stat: {e}")
    if len(before) != 8 or len(after) != 8:
        fail(f"{path}: a `cpu` line of /proc/stat has 8 counts or more, this one fewer")
    delta = [b - a for a, b in zip(before, after)]
    total = sum(delta)
    return delta[7] / total if total > 0 else None


def verdict(ok):
    return "pass" if ok else "FAIL"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, help="the directory vs_jax.sh filled")
    ap.add_argument("--backend", default="llvm")
    ap.add_argument("--quick", default="0")
    ap.add_argument("--out", default="target/vs_jax.json")
    ap.add_argument("--strict", action="store_true", help="exit 2 if a bar is not met")
    ap.add_argument("--isa", choices=ISA_WIDEST, default="native",
                    help="what both sides were limited to (vs_jax.sh --isa): avx2 reads the 256-bit FMA peak")
    args = ap.parse_args()
    work = args.work
    if not os.path.isdir(work):
        fail(f"--work {work} is not a directory")

    round_dirs = sorted(
        (d for d in os.listdir(work) if re.fullmatch(r"round\d+", d)), key=lambda d: int(d[len("round"):])
    )
    if not round_dirs:
        fail(f"no round1/ … in {work}")
    rounds = [load_round(os.path.join(work, d)) for d in round_dirs]
    jax = rounds[0]["jax"]
    peak, peak_what, peak_all = fma_peak(os.path.join(work, "fma.txt"), ISA_WIDEST[args.isa])

    try:
        with open(os.path.join(work, "busy_before.txt")) as f:
            busy_before = float(f.read().strip())
    except (OSError, ValueError):
        busy_before = None

    rows = []
    for model in MODELS:
        for mode in MODES:
            name = JAX_ROW[mode].format(model)
            per_round = []
            for r in rounds:
                d = r["dfc"][f"{model}_{mode}"]
                j = r["jax_rows"].get(name)
                if j is None:
                    fail(f"the peer's JSON in {r['dir']} has no row `{name}`")
                per_round.append(
                    dict(
                        dfc_median_us=d["median_step_us"],
                        dfc_p10_us=d["p10_step_us"],
                        dfc_p90_us=d["p90_step_us"],
                        jax_median_us=j["median_us"],
                        jax_p10_us=j["p10_us"],
                        jax_p90_us=j["p90_us"],
                        ratio=d["median_step_us"] / j["median_us"],
                        dfc_steps=d["steps"],
                        jax_steps=j["n"],
                    )
                )
            mid = lambda key: statistics.median(x[key] for x in per_round)  # noqa: E731
            first = rounds[0]["dfc"][f"{model}_{mode}"]
            ratio = mid("ratio")
            bar = BARS[mode].get(model)
            rows.append(
                dict(
                    model=model,
                    dfc_model=first["model"],
                    mode=mode,
                    dfc_median_us=mid("dfc_median_us"),
                    dfc_p10_us=mid("dfc_p10_us"),
                    dfc_p90_us=mid("dfc_p90_us"),
                    dfc_gflops=first["gflops"] * first["median_step_us"] / mid("dfc_median_us"),
                    jax_median_us=mid("jax_median_us"),
                    jax_p10_us=mid("jax_p10_us"),
                    jax_p90_us=mid("jax_p90_us"),
                    ratio=ratio,
                    round_ratios=[x["ratio"] for x in per_round],
                    rounds=per_round,
                    dfc_spread=statistics.median(x["dfc_p90_us"] / x["dfc_p10_us"] for x in per_round),
                    jax_spread=statistics.median(x["jax_p90_us"] / x["jax_p10_us"] for x in per_round),
                    bar=bar,
                    passed=None if bar is None else ratio <= bar,
                )
            )
    by_row = {(r["model"], r["mode"]): r for r in rows}

    mlp_gflops = MLP_TRAIN_FLOPS / (by_row[("mlp", "train")]["dfc_median_us"] * 1e-6) / 1e9
    peak_share = mlp_gflops / peak
    throughput = dict(
        flops_per_step=MLP_TRAIN_FLOPS,
        dfc_gflops=mlp_gflops,
        fma_peak_gflops=peak,
        fma_peak_line=peak_what,
        fma_all=[dict(bits=b, threads=t, gflops=g) for (b, t), g in sorted(peak_all.items())],
        share_of_peak=peak_share,
        bar=PEAK_BAR,
        passed=peak_share >= PEAK_BAR,
    )

    with open(os.path.join(work, "compile_ms.txt")) as f:
        compile_runs_ms = [int(line) / 1e3 for line in f if line.strip()]
    compile_ms = statistics.median(compile_runs_ms)
    peer_compile = jax.get("compile", {})
    first_call = peer_compile.get("mlp_train_first_call_ms")
    xla = peer_compile.get("mlp_train_xla_compile_ms")
    compile_info = dict(
        dfc_compile_ms=compile_ms,
        dfc_compile_runs_ms=compile_runs_ms,
        jax_first_call_ms=first_call,
        jax_xla_compile_ms=xla,
        ratio_to_first_call=compile_ms / first_call if first_call else None,
        ratio_to_xla_compile=compile_ms / xla if xla else None,
    )

    threads = rounds[0]["dfc"]["mlp_train"]["threads"]
    print()
    print(f"dfc ({args.backend} backend, {threads} threads) vs JAX {jax.get('versions', {}).get('jax', '?')} "
          f"(XLA CPU), {os.cpu_count()} CPUs{' [quick]' if args.quick == '1' else ''}")
    if args.isa == "avx2":
        print("--isa avx2: both sides limited to AVX2 + FMA (AVX-512 and AMX hidden from their CPUID by "
              "benches/avx2_only.c), the FMA peak of 256-bit vectors: a CPU without AVX-512, as far as this CPU "
              "can stand for one")
    print()
    print(f"(batch1: inference at batch 1; {len(rounds)} round(s), dfc then JAX in each: µs and spread are medians "
          "of the rounds', dfc/JAX the median of the rounds' ratios; spread: p90/p10 of the step's time)")
    header = (f"{'model':<7} {'mode':<10} {'dfc µs':>11} {'JAX µs':>11} {'dfc/JAX':>9} {'bar':>7}  {'result':<6} "
              f"{'dfc spread':>10} {'JAX spread':>10}  rounds' dfc/JAX")
    print(header)
    print("-" * len(header))
    for r in rows:
        bar = f"≤ {r['bar']:.1f}" if r["bar"] is not None else "-"
        result = verdict(r["passed"]) if r["passed"] is not None else "-"
        print(f"{r['model']:<7} {r['mode']:<10} {r['dfc_median_us']:>11.1f} {r['jax_median_us']:>11.1f} "
              f"{r['ratio']:>9.2f} {bar:>7}  {result:<6} {r['dfc_spread']:>10.2f} {r['jax_spread']:>10.2f}  "
              + " ".join(f"{x:.2f}" for x in r["round_ratios"]))
    print()
    print(f"mlp train step: {mlp_gflops:.2f} GFLOP/s (peer count {MLP_TRAIN_FLOPS / 1e6:.1f} MFLOP/step) "
          f"= {100 * peak_share:.1f}% of the FMA peak {peak:.1f} GFLOP/s ({peak_what}); "
          f"bar ≥ {100 * PEAK_BAR:.0f}%: {verdict(throughput['passed'])}")
    first = f"{first_call:.1f} ms (dfc/JAX {compile_ms / first_call:.3f})" if first_call else "?"
    xla_text = f"{xla:.1f} ms (dfc/JAX {compile_ms / xla:.3f})" if xla else "?"
    print(f"mlp compile: dfc compile {compile_ms:.1f} ms (median of {len(compile_runs_ms)} processes); "
          f"JAX first call {first}, XLA compile {xla_text}")

    bars = [r["passed"] for r in rows if r["passed"] is not None] + [throughput["passed"]]
    met = sum(1 for b in bars if b)
    print(f"\n{met} of {len(bars)} bars met")
    if busy_before is not None and busy_before > 0.25:
        print(f"note: other work kept {busy_before} CPUs busy just before timing: the figures are perturbed")
    stolen = [r["stolen"] for r in rounds]
    if any(v is not None for s in stolen for v in s.values()):
        share = lambda v: "?" if v is None else f"{100 * v:.1f}%"  # noqa: E731
        print("CPU time stolen by the hypervisor, dfc / JAX, per round: "
              + ", ".join(f"{i + 1}: {share(s['dfc'])} / {share(s['jax'])}" for i, s in enumerate(stolen)))
        if any(v is not None and v > STOLEN_NOTE for s in stolen for v in s.values()):
            print(f"note: a round lost more than {100 * STOLEN_NOTE:.0f}% of its CPU time to the hypervisor: "
                  "that side was timed on a slower machine")
    trips = [r["round_trips"] for r in rounds]
    if any(t for s in trips for t in s.values()):
        span = lambda t: "?" if not t else "–".join(f"{x:.0f}" for x in (min(t), max(t)))  # noqa: E731
        print("round trip between CPUs 0 and 1 (ns, before and after), dfc / JAX, per round: "
              + ", ".join(f"{i + 1}: {span(s['dfc'])} / {span(s['jax'])}" for i, s in enumerate(trips)))
        if any(x > FAR_ROUND_TRIP_NS for s in trips for t in s.values() for x in t):
            print(f"note: a round trip above {FAR_ROUND_TRIP_NS} ns: the two CPUs shared no cache then (a slow "
                  "spell: every line one wrote and the other read crossed between them), or other work held one")

    result = dict(
        backend=args.backend,
        isa=args.isa,
        quick=args.quick == "1",
        machine=dict(cpus=os.cpu_count(), platform=platform.platform(), processor=cpu_model(), busy_cpus_before=busy_before),
        dfc_threads=threads,
        peer_versions=jax.get("versions"),
        rounds=len(rounds),
        stolen_per_round=stolen,
        round_trip_ns_per_round=trips,
        rows=rows,
        mlp_train_throughput=throughput,
        compile=compile_info,
        bars_met=met,
        bars=len(bars),
        dfc_raw=[r["dfc"] for r in rounds],
        jax_raw=[r["jax"] for r in rounds],
        jax_batch1_raw=[r["jax_batch1"] for r in rounds],
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}")
    if args.strict and met < len(bars):
        sys.exit(2)


def load_round(path):
    """One round's reports: dfc's by `model_mode`, the peer's two files, and the peer's rows by name."""
    dfc = {f"{m}_{mode}": load_json(os.path.join(path, f"dfc_{m}_{mode}.json")) for m in MODELS for mode in MODES}
    jax = load_json(os.path.join(path, "jax.json"))
    jax_batch1 = load_json(os.path.join(path, "jax_batch1.json"))
    jax_rows = {r["bench"]: r for r in jax.get("rows", []) + jax_batch1.get("rows", [])}
    stolen = {side: stolen_share(os.path.join(path, f"stat_{side}.txt")) for side in ("dfc", "jax")}
    trips = {side: round_trips(os.path.join(path, f"round_trip_{side}.txt")) for side in ("dfc", "jax")}
    return dict(dir=path, dfc=dfc, jax=jax, jax_batch1=jax_batch1, jax_rows=jax_rows, stolen=stolen,
                round_trips=trips)


def round_trips(path):
    """The round trips (ns) in `path`, one a line, or [] without the file."""
    try:
        with open(path) as f:
            return [float(line) for line in f if line.strip()]
    except OSError:
        return []
    except ValueError as e:
        fail(f"{path}: not a round trip in ns: {e}")


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


if __name__ == "__main__":
    main()

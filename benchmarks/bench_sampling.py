"""Benchmark of fedshard.sampling: exact solvers vs the paper's literal algorithms, CPS vs R.

Prints one JSON object.  Everything is compared side by side in this process on the same
spectrum: N = 512 singular values (a heavy-tailed synthetic spectrum, sorted Gamma(0.5) draws),
n = 52 kept terms (keep ratio 0.1), C = 10 clients.  The literal Algorithms 1 and 2 live in
tests/sampling/paper_algorithms.py.  Where `Rscript` with the CRAN package `sampling` is
installed, R's `UPmaxentropy` (one call per draw, each redoing its setup, as the package is
used) is timed inside R (`system.time`, R start-up excluded) for the same π.

Usage: python benchmarks/bench_sampling.py [--r-draws 100] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "sampling"))

from machine import cpu_name  # noqa: E402
from paper_algorithms import (  # noqa: E402
    algorithm1_unbiased,
    algorithm2_collective,
    collective_objective,
    unbiased_objective,
)

from fedshard.sampling import (  # noqa: E402
    Brewer,
    ConditionalPoisson,
    MinimumSupport,
    inclusion_probabilities,
    successive_sample,
)

N, SMALL_N, CLIENTS = 512, 52, 10

R_SCRIPT = """
suppressMessages(library(sampling))
args <- commandArgs(trailingOnly = TRUE)
pik <- scan(args[1], quiet = TRUE)
draws <- as.integer(args[2])
set.seed(1)
elapsed <- system.time(for (i in seq_len(draws)) s <- UPmaxentropy(pik))[["elapsed"]]
cat(sprintf("%.6f\\n", elapsed))
"""


def best_time(fn: Callable[[], object], repeats: int, number: int = 1) -> float:
    """Smallest wall time of ``number`` calls over ``repeats`` runs, in seconds per call."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - start) / number)
    return best


def spectrum(seed: int, size: int = N) -> np.ndarray:
    return np.sort(np.random.default_rng([2024, seed]).gamma(0.5, size=size))[::-1]


def objective_gaps(lam: np.ndarray) -> tuple[float, float]:
    """Relative gaps (ours - literal) / literal of the Theorem 1 and Theorem 2 objectives."""
    pi_u, _ = inclusion_probabilities(lam, SMALL_N, "unbiased")
    e_ours = unbiased_objective(lam, pi_u)
    e_ref = unbiased_objective(lam, algorithm1_unbiased(lam, SMALL_N))
    pi_c, omega_c = inclusion_probabilities(lam, SMALL_N, "collective", num_clients=CLIENTS)
    c_ours = collective_objective(lam, pi_c, omega_c, CLIENTS)
    pi_r, w_r = algorithm2_collective(lam, SMALL_N, CLIENTS)
    c_ref = collective_objective(lam, pi_r, w_r, CLIENTS)
    return (e_ours - e_ref) / e_ref, (c_ours - c_ref) / c_ref


def time_r(pi: np.ndarray, draws: int) -> float | None:
    """Seconds R's UPmaxentropy needs for `draws` draws, or None without R/sampling."""
    if shutil.which("Rscript") is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        pik = Path(tmp) / "pik.txt"
        np.savetxt(pik, pi, fmt="%.17g")
        script = Path(tmp) / "bench.R"
        script.write_text(R_SCRIPT)
        try:
            out = subprocess.run(
                ["Rscript", str(script), str(pik), str(draws)],
                capture_output=True,
                text=True,
                check=True,
                timeout=3600,
            )
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            return None
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--r-draws", type=int, default=100, help="UPmaxentropy draws (0: skip)")
    parser.add_argument("--repeats", type=int, default=5, help="timing repeats (best is kept)")
    args = parser.parse_args()
    reps = args.repeats
    lam = spectrum(0)
    result: dict[str, object] = {
        "N": N,
        "n": SMALL_N,
        "C": CLIENTS,
        "spectrum": "sorted Gamma(0.5) draws, numpy default_rng([2024, seed])",
        "python": platform.python_version(),
        "numpy": np.__version__,
        "machine": platform.machine(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
    }

    # Strategy solvers vs the literal algorithms (same spectrum, same process).
    t_alg1 = best_time(lambda: algorithm1_unbiased(lam, SMALL_N), reps)
    t_unb = best_time(lambda: inclusion_probabilities(lam, SMALL_N, "unbiased"), reps, 20)
    t_alg2 = best_time(lambda: algorithm2_collective(lam, SMALL_N, CLIENTS), max(1, reps // 2))
    t_col = best_time(
        lambda: inclusion_probabilities(lam, SMALL_N, "collective", num_clients=CLIENTS), reps, 20
    )
    gaps = [objective_gaps(spectrum(seed)) for seed in range(10)]
    result.update(
        algorithm1_ms=1e3 * t_alg1,
        unbiased_solver_us=1e6 * t_unb,
        unbiased_speedup_vs_algorithm1=t_alg1 / t_unb,
        algorithm2_ms=1e3 * t_alg2,
        collective_solver_us=1e6 * t_col,
        collective_speedup_vs_algorithm2=t_alg2 / t_col,
        # Relative objective gap over 10 spectra (the first is the timed one); negative would
        # mean the literal algorithm found a worse point.
        max_objective_gap=max(abs(g) for pair in gaps for g in pair),
        max_unbiased_objective_gap=max(abs(g[0]) for g in gaps),
        max_collective_objective_gap=max(abs(g[1]) for g in gaps),
    )

    # Designs for the unbiased π of the same spectrum.
    pi, _ = inclusion_probabilities(lam, SMALL_N, "unbiased")
    t_setup = best_time(lambda: ConditionalPoisson(pi), reps)
    cps = ConditionalPoisson(pi)
    t_batch = best_time(lambda: cps.sample(100, rng=0), reps)
    t_single = best_time(lambda: cps.sample(1, rng=0), reps, 20)
    t_cps_100 = best_time(lambda: ConditionalPoisson(pi).sample(100, rng=0), reps)
    result.update(
        cps_fractional_units=int(((pi > 0) & (pi < 1)).sum()),
        cps_fit_error=cps.fit_error,
        cps_setup_ms=1e3 * t_setup,
        cps_draw_us=1e6 * t_batch / 100,
        cps_single_draw_us=1e6 * t_single,
        cps_100_draws_with_setup_ms=1e3 * t_cps_100,
        brewer_100_draws_ms=1e3 * best_time(lambda: Brewer(pi).sample(100, rng=0), reps),
        min_support_100_draws_with_setup_ms=1e3
        * best_time(lambda: MinimumSupport(pi).sample(100, rng=0), reps),
        successive_100_draws_ms=1e3
        * best_time(lambda: successive_sample(lam**4, SMALL_N, 100, rng=0), reps),
    )

    # A large layer: N = 4608, keep ratio 0.2 (setup only, once).
    big = spectrum(100, 4608)
    pi_big, _ = inclusion_probabilities(big, 922, "unbiased")
    result["cps_setup_ms_N4608_n922"] = 1e3 * best_time(lambda: ConditionalPoisson(pi_big), 1)

    if args.r_draws > 0:
        r_seconds = time_r(pi, args.r_draws)
        if r_seconds is not None:
            ours = best_time(lambda: ConditionalPoisson(pi).sample(args.r_draws, rng=0), reps)
            result.update(
                r_upmaxentropy_draws=args.r_draws,
                r_upmaxentropy_s=r_seconds,
                cps_same_draws_with_setup_s=ours,
                cps_speedup_vs_r_upmaxentropy=r_seconds / ours,
            )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

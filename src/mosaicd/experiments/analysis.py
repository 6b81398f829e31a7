"""`mosaicd analyze`: how fast consensus is reached on identical quadratics, in theory and in simulation.

Setting (the paper's quadratic claim): n nodes, one model of d coordinates each, every node minimises
the same f(x) = ||x||_A^2 = x^T A x (x* = 0, A symmetric d x d). One round of node i: a local step
x <- G x with G = (I - 2 eta A)^H (H gradient steps of size eta), then fragment-wise gossip averaging.
Stack the nodes' models as X (n x d). Gossip of fragment k is a row-stochastic n x n matrix W_k (row p
averages p's own values with those it received: W_k[p, i] = 1/(1 + |R_k(p)|) for i in {p} + R_k(p)), and
D_k = diag(1[C == k]) selects fragment k's coordinates. In the stacked (node-major) n*d state the round is

    x_{t+1} = P_t (I_n (x) G) x_t,      P_t = sum_k W_{t,k} (x) D_k.

Disagreement: Q = (I_n - 11^T/n) (x) I_d projects on the orthogonal complement of consensus; the consensus
error is e_t = ||Q x_t||^2 = sum_i ||x_i - mean_j x_j||^2. Consensus vectors stay consensus vectors
(W 1 = 1), so Q M = Q M Q for each one-round map M, and E[e_{t+1} | x_t] <= rho e_t with

    rho = lambda_max( E[ (Q M U)^T (Q M U) ] ),   U = U_n (x) I_d, U_n an orthonormal basis of 1-perp,

the expectation over the sampler's random graphs. We compute rho for two ways of reading the same round:

- `rho_after_gossip`: state observed at round boundaries (after gossip), M = P_t (I (x) G): the literal
  "local step, then gossip" map. Here E[M^T Q M] = S (x) G^2 with S = E[W^T Q_n W], because fragments are
  disjoint (D_k D_l = 0): this one-round quantity does not depend on K, whatever A is.
- `rho_after_step`: state observed right after the local step, M = (I (x) G) P_t (the same process shifted
  by half a round, so it has the same long-run rate). Here the coordinate mixing of G acts after the
  fragment-wise averaging and
      E[M^T Q M] = T (x) G^2 + (S - T) (x) (G^2 o B),   T = E[W]^T Q_n E[W],
  B[j, l] = 1 if C(j) == C(l) (o: elementwise product), using that different fragments' graphs are
  independent draws of the same law (local, oracle). With diagonal A, G^2 o B = G^2 and rho equals the
  K = 1 value; with correlated A the cross-fragment terms average over independent graphs (T <= S), so
  rho falls as K grows. For `static` every fragment uses the same fixed graph, S = T, and K is irrelevant.

S and E[W] are estimated from --samples sampled rounds of the run's sampler (fragment 0 of rounds
0..samples-1, seed --seed); everything else is exact. The simulation runs `mosaic_proto.InMemoryNetwork`
(real RoundStates and wire messages, float32 models) with `mosaic_proto.Quadratic` (x* = 0) for --rounds
rounds, --repeats seeds (seed, seed+1, ...), and records e_t averaged over the repeats; `sim_rate` is its
per-round factor over the second half of the rounds, (e_T / e_{T/2})^(1/(T - T/2)), to compare with rho
(an upper bound on it in expectation). With few repeats sim_rate is noisy (with K = 1 all coordinates
share one graph sequence): with diagonal A, --repeats 30 gives equal rates for every K.
Float32 models put a floor near e_t / e_0 ~ 1e-14, so keep --rounds small (default 20).

Outputs (--out): analysis.csv (one row per matrix and K), analysis_rounds.csv (e_t per matrix, K, round),
consensus.png (e_t vs rounds per K, log y, one column per matrix; below it rho and sim_rate vs K), and
the table on stdout. Cost: a ((n-1) d)^2 eigenproblem per (matrix, K) -- seconds at n = d = 16.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mosaic_proto import (
    Curvature,
    Fragmentation,
    InMemoryNetwork,
    Layout,
    PeerSampler,
    Quadratic,
    SamplerKind,
    Strategy,
    consensus_error,
    curvature_matrix,
)
from mosaicd.extras import needs, require
from mosaicd.files import replacing, write_whole

HELP = "spectral consensus rate of Mosaic gossip on identical quadratics, and the simulated consensus error"

DENSE_MAX = 2500  # above this (n-1)*d, lambda_max comes from a Lanczos solver on the Kronecker structure


# ---------------------------------------------------------------------------------------------- the maps


def mixing_matrix(sampler: PeerSampler, round: int, fragment: int, n: int) -> np.ndarray:
    """W (n x n) of one fragment in one round: row p averages p's values with those p received."""
    members = list(range(n))
    w = np.eye(n)
    for i in members:
        for p in sampler.receivers(round, i, fragment, members):
            w[p, i] = 1.0
    return w / w.sum(axis=1, keepdims=True)


def step_matrix(a: np.ndarray, lr: float, local_steps: int = 1) -> np.ndarray:
    """G = (I - 2 lr A)^H: H gradient steps on ||x||_A^2."""
    g = np.eye(a.shape[0]) - 2.0 * lr * a
    return np.linalg.matrix_power(g, local_steps)


def round_map(sampler: PeerSampler, fragmentation: Fragmentation, g: np.ndarray, round: int, n: int) -> np.ndarray:
    """The dense (n d) x (n d) map of one round, local step then gossip: P_t (I_n (x) G), node-major."""
    d = g.shape[0]
    m = np.zeros((n * d, n * d))
    for k in range(fragmentation.k):
        dk = np.diag((fragmentation.assignment == k).astype(float))
        m += np.kron(mixing_matrix(sampler, round, k, n), dk @ g)
    return m


def disagreement_basis(n: int) -> np.ndarray:
    """U_n: n x (n-1), orthonormal columns spanning the vectors orthogonal to 1."""
    u, _, _ = np.linalg.svd(np.eye(n) - np.full((n, n), 1.0 / n))
    return u[:, : n - 1]


@dataclass
class Moments:
    """S = E[W^T Q W] and T = E[W]^T Q E[W], restricted to 1-perp (U_n^T . U_n)."""

    s: np.ndarray
    t: np.ndarray
    samples: int

    @classmethod
    def estimate(cls, sampler: PeerSampler, n: int, samples: int) -> Moments:
        q = np.eye(n) - np.full((n, n), 1.0 / n)
        u = disagreement_basis(n)
        count = 1 if sampler.kind is SamplerKind.STATIC else samples  # one fixed graph
        s_sum, w_sum = np.zeros((n, n)), np.zeros((n, n))
        for t in range(count):
            w = mixing_matrix(sampler, t, 0, n)
            s_sum += w.T @ q @ w
            w_sum += w
        w_mean = w_sum / count
        return cls(u.T @ (s_sum / count) @ u, u.T @ (w_mean.T @ q @ w_mean) @ u, count)


def _lambda_max(terms: list[tuple[np.ndarray, np.ndarray]]) -> float:
    """Largest eigenvalue of the symmetric sum_i A_i (x) B_i."""
    size = terms[0][0].shape[0] * terms[0][1].shape[0]
    if size <= DENSE_MAX:
        return float(np.linalg.eigvalsh(sum(np.kron(a, b) for a, b in terms))[-1])
    with needs(f"an eigenproblem of size {size} > {DENSE_MAX}"):
        from scipy.sparse.linalg import LinearOperator, eigsh

    rows, cols = terms[0][0].shape[0], terms[0][1].shape[0]

    def matvec(v: np.ndarray) -> np.ndarray:
        y = v.reshape(rows, cols)
        return sum(a @ y @ b.T for a, b in terms).reshape(-1)

    op = LinearOperator((size, size), matvec=matvec, dtype=float)
    return float(eigsh(op, k=1, which="LA", return_eigenvectors=False, tol=1e-10)[0])


def rho_after_gossip(moments: Moments, g: np.ndarray) -> float:
    """lambda_max of E[(QMU)^T QMU] for M = P (I (x) G): S (x) G^2 (independent of K)."""
    return _lambda_max([(moments.s, g @ g)])


def rho_after_step(moments: Moments, g: np.ndarray, fragmentation: Fragmentation) -> float:
    """lambda_max of E[(QMU)^T QMU] for M = (I (x) G) P: T (x) G^2 + (S - T) (x) (G^2 o same-fragment)."""
    c = fragmentation.assignment
    g2 = g @ g
    return _lambda_max([(moments.t, g2), (moments.s - moments.t, g2 * (c[:, None] == c[None, :]))])


# ---------------------------------------------------------------------------------------------- simulation


def simulate_consensus(a: np.ndarray, n: int, k: int, sampler: str, fanout: int, lr: float, local_steps: int,
                       rounds: int, seed: int, strategy: str = "random") -> list[float]:
    """e_t = sum_i ||x_i - mean x||^2 before round 0 and after each round (InMemoryNetwork, x* = 0)."""
    d = a.shape[0]
    quad = Quadratic(a, np.zeros((n, d)), seed, lr=lr, local_steps=local_steps)
    fragmentation = Fragmentation.build(Layout.flat(d), k, seed, strategy)
    net = InMemoryNetwork([quad.initial(i) for i in range(n)], fragmentation, PeerSampler(sampler, fanout, seed),
                          quad.train, run_id="analysis")
    errors = [consensus_error(net.matrix())]
    for _ in range(rounds):
        net.step()
        errors.append(consensus_error(net.matrix()))
    return errors


# ---------------------------------------------------------------------------------------------- the command


def load_matrix(name: str, d: int, seed: int) -> np.ndarray:
    return curvature_matrix(d, Curvature(name), seed)


def read_matrix_file(path: Path) -> np.ndarray:
    a = np.load(path, allow_pickle=False)
    if a.ndim != 2 or a.shape[0] != a.shape[1] or a.shape[0] == 0:
        raise ValueError(f"--matrix-file {path}: need a square d x d matrix, got shape {a.shape}")
    a = a.astype(np.float64)
    if not np.all(np.isfinite(a)):
        raise ValueError(f"--matrix-file {path}: holds non-finite values")
    if not np.allclose(a, a.T, rtol=1e-8, atol=1e-10 * max(1.0, float(np.abs(a).max()))):
        raise ValueError(f"--matrix-file {path}: A must be symmetric (f(x) = x^T A x uses (A + A^T)/2; "
                         f"symmetrise it first)")
    return a


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


EPILOG = """\
what is computed (details: the docstring of mosaicd/analysis.py):
  one round: x <- (I - 2 eta A)^H x on every node, then fragment-wise gossip; stacked n*d state:
  x_{t+1} = P_t (I (x) G) x_t. e_t = sum_i ||x_i - mean x||^2 (consensus error).
  rho_after_step   = lambda_max E[(Q M U)^T (Q M U)], M = (I (x) G) P_t  (state read after the local step)
  rho_after_gossip = the same for M = P_t (I (x) G)  (state read after gossip; provably independent of K)
  Q: projector on the disagreement subspace, U: an orthonormal basis of it; E[e_{t+1}] <= rho E[e_t].
  E over the sampler's graphs, estimated from --samples sampled rounds; sim_rate: measured per-round factor.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("--nodes", "-n", type=int, default=16, help="nodes n [default: 16]")
    parser.add_argument("--dim", "-d", type=int, default=None, help="model size d [default: 16, or the file's]")
    parser.add_argument("--fragments", "-K", type=_ints, default=[1, 2, 4, 8, 16],
                        help="comma-separated K values [default: 1,2,4,8,16]")
    parser.add_argument("--sampler", choices=[k.value for k in SamplerKind], default="local",
                        help="gossip: local (EL-Local), oracle (EL-Oracle), static (D-PSGD) [default: local]")
    parser.add_argument("--fanout", "-s", type=int, default=2, help="receivers s per fragment [default: 2]")
    parser.add_argument("--matrix", default=None,
                        help="built-in A, comma-separated: correlated, diagonal [default: both; none with "
                             "--matrix-file]")
    parser.add_argument("--matrix-file", type=Path, default=None, help="A as a .npy d x d symmetric matrix")
    parser.add_argument("--lr", type=float, default=0.05, help="step size eta [default: 0.05]")
    parser.add_argument("--local-steps", type=int, default=1, help="gradient steps H per round [default: 1]")
    parser.add_argument("--strategy", choices=[s.value for s in Strategy], default="random",
                        help="fragmentation [default: random]")
    parser.add_argument("--samples", type=int, default=400, help="sampled rounds for E[.] [default: 400]")
    parser.add_argument("--rounds", type=int, default=20, help="simulated rounds [default: 20]")
    parser.add_argument("--repeats", type=int, default=3, help="simulation seeds, averaged [default: 3]")
    parser.add_argument("--seed", type=int, default=0, help="seed of A (correlated), sampler, fragments, x_0")
    parser.add_argument("--out", type=Path, default=Path("runs/analysis"), help="[default: runs/analysis]")
    parser.add_argument("--no-plot", action="store_true", help="skip consensus.png")


def check(args: argparse.Namespace) -> None:
    problems = []
    if args.nodes < 2:
        problems.append(f"--nodes {args.nodes}: need at least 2 nodes")
    if not 1 <= args.fanout < args.nodes:
        problems.append(f"--fanout {args.fanout}: need 1 <= s < n = {args.nodes}")
    if args.dim is not None and args.dim < 1:
        problems.append(f"--dim {args.dim}: need d >= 1")
    if args.lr <= 0:
        problems.append(f"--lr {args.lr}: must be > 0")
    for name in ("local_steps", "samples", "repeats"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.rounds < 2:
        problems.append(f"--rounds {args.rounds}: need at least 2")
    if problems:
        raise ValueError("; ".join(problems))


def matrices(args: argparse.Namespace) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    if args.matrix_file is not None:
        a = read_matrix_file(args.matrix_file)
        if args.dim is not None and args.dim != a.shape[0]:
            raise ValueError(f"--dim {args.dim} differs from --matrix-file {args.matrix_file}'s d = {a.shape[0]}")
        out[f"file:{args.matrix_file.name}"] = a
    d = args.dim or (next(iter(out.values())).shape[0] if out else 16)
    names = args.matrix if args.matrix is not None else ("" if out else "correlated,diagonal")
    for name in [x.strip() for x in names.split(",") if x.strip()]:
        if name not in (c.value for c in Curvature):
            raise ValueError(f"--matrix {name}: expected correlated or diagonal")
        out[name] = load_matrix(name, d, args.seed)
    if not out:
        raise ValueError("no matrix: give --matrix and/or --matrix-file")
    return out


def analyze(args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    check(args)
    mats = matrices(args)
    n = args.nodes
    sampler = PeerSampler(args.sampler, args.fanout, args.seed)
    moments = Moments.estimate(sampler, n, args.samples)
    rows, curves = [], []
    for name, a in mats.items():
        d = a.shape[0]
        bad = [k for k in args.fragments if k > d]
        if bad:
            raise ValueError(f"--fragments {bad}: more than the model's d = {d} coordinates")
        g = step_matrix(a, args.lr, args.local_steps)
        eig = np.linalg.eigvalsh(a)
        for k in args.fragments:
            started = time.perf_counter()
            fragmentation = Fragmentation.build(Layout.flat(d), k, args.seed, args.strategy)
            r_step = rho_after_step(moments, g, fragmentation)
            r_gossip = rho_after_gossip(moments, g)
            runs = [simulate_consensus(a, n, k, args.sampler, args.fanout, args.lr, args.local_steps, args.rounds,
                                       args.seed + r, args.strategy) for r in range(args.repeats)]
            mean = np.mean(np.array(runs), axis=0)
            half = args.rounds // 2
            rate = float((mean[-1] / mean[half]) ** (1.0 / (args.rounds - half))) if mean[half] > 0 else math.nan
            rows.append({"matrix": name, "K": k, "sampler": args.sampler, "s": args.fanout, "n": n, "d": d,
                         "lr": args.lr, "H": args.local_steps, "A_eig_min": float(eig[0]),
                         "A_eig_max": float(eig[-1]), "rho_after_step": r_step, "rho_after_gossip": r_gossip,
                         "sim_rate": rate, "e_0": float(mean[0]), "e_final": float(mean[-1]),
                         "samples": moments.samples, "repeats": args.repeats,
                         "seconds": round(time.perf_counter() - started, 3)})
            curves += [{"matrix": name, "K": k, "round": t, "consensus_error": float(e)} for t, e in enumerate(mean)]
    return rows, curves


def print_table(rows: list[dict]) -> None:
    cols = [("matrix", "{}"), ("K", "{}"), ("sampler", "{}"), ("s", "{}"), ("n", "{}"), ("d", "{}"),
            ("rho_after_step", "{:.5f}"), ("rho_after_gossip", "{:.5f}"), ("sim_rate", "{:.5f}"),
            ("e_final", "{:.3e}")]
    cells = [[fmt.format(r[c]) for c, fmt in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, (c, _) in enumerate(cols)]
    print("  ".join(c.rjust(w) for (c, _), w in zip(cols, widths, strict=True)))
    for line in cells:
        print("  ".join(x.rjust(w) for x, w in zip(line, widths, strict=True)))


def plot(rows: list[dict], curves: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["matrix"] for r in rows))
    ks = sorted({r["K"] for r in rows})
    cmap = matplotlib.colormaps["viridis"]
    colors = {k: cmap(0.9 * i / max(1, len(ks) - 1)) for i, k in enumerate(ks)}
    fig, axes = plt.subplots(2, len(names), figsize=(5.8 * len(names), 8.2), squeeze=False, sharey="row",
                             gridspec_kw={"height_ratios": [3, 2]})
    first = rows[0]
    for col, name in enumerate(names):
        ax = axes[0][col]
        for k in ks:
            pts = [c for c in curves if c["matrix"] == name and c["K"] == k]
            ax.plot([c["round"] for c in pts], [c["consensus_error"] for c in pts], color=colors[k], lw=1.8,
                    label=f"K={k}")
        ax.set_yscale("log")
        ax.set_xlabel("round")
        ax.set_ylabel("consensus error sum_i ||x_i - x_mean||^2")
        ax.set_title(f"consensus error vs rounds, A {name}")
        ax.grid(alpha=0.3, which="major")
        ax.legend(fontsize=8)
        ax = axes[1][col]
        mine = [r for r in rows if r["matrix"] == name]
        x = [r["K"] for r in mine]
        ax.plot(x, [r["rho_after_step"] for r in mine], "o-", label="rho, M = (I x G) P (after step)")
        ax.plot(x, [r["rho_after_gossip"] for r in mine], "s--", label="rho, M = P (I x G) (after gossip)")
        ax.plot(x, [r["sim_rate"] for r in mine], "^:", label="simulated per-round factor")
        ax.set_xscale("log", base=2)
        ax.set_xticks(x)
        ax.set_xticklabels([str(v) for v in x])
        ax.set_xlabel("fragments K")
        ax.set_ylabel("per-round factor of E[consensus error]")
        ax.set_title(f"spectral bound vs K, A {name}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"identical quadratics ||x||_A^2: n={first['n']}, d={first['d']}, sampler {first['sampler']}, "
                 f"s={first['s']}, eta={first['lr']}, H={first['H']}; simulation mean over {first['repeats']} seeds",
                 fontsize=10)
    fig.tight_layout()
    with replacing(path) as f:
        fig.savefig(f, dpi=110, format=path.suffix.lstrip("."))
    plt.close(fig)
    return path


def _write_csv(path: Path, rows: list[dict]) -> None:
    text = io.StringIO()
    writer = csv.DictWriter(text, list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    write_whole(path, text.getvalue())


def main(args: argparse.Namespace) -> int:
    if not args.no_plot:
        require("drawing the figure (--no-plot skips it)", "matplotlib")
    rows, curves = analyze(args)
    args.out.mkdir(parents=True, exist_ok=True)
    _write_csv(args.out / "analysis.csv", rows)
    _write_csv(args.out / "analysis_rounds.csv", curves)
    print_table(rows)
    files = [str(args.out / "analysis.csv"), str(args.out / "analysis_rounds.csv")]
    if not args.no_plot:
        files.append(str(plot(rows, curves, args.out / "consensus.png")))
    print(json.dumps({"out": str(args.out), "files": files}))
    return 0

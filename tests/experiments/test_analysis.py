"""`mosaicd analyze`: the one-round map, the spectral quantity, and the command's outputs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from mosaic_proto import Fragmentation, InMemoryNetwork, Layout, PeerSampler, Quadratic, curvature_matrix
from mosaicd.cli import main
from mosaicd.experiments.analysis import (
    Moments,
    disagreement_basis,
    rho_after_gossip,
    rho_after_step,
    round_map,
    step_matrix,
)


@pytest.mark.parametrize("kind", ["local", "oracle", "static"])
def test_round_map_is_one_network_round(kind: str) -> None:
    n, d, k, lr = 6, 8, 4, 0.05
    a = curvature_matrix(d, "correlated", 3)
    quad = Quadratic(a, np.zeros((n, d)), 3, lr=lr)
    fragmentation = Fragmentation.build(Layout.flat(d), k, 3)
    sampler = PeerSampler(kind, 2, 3)
    net = InMemoryNetwork([quad.initial(i) for i in range(n)], fragmentation, sampler, quad.train)
    x0 = net.matrix().astype(np.float64).reshape(-1)
    net.step()
    expected = round_map(sampler, fragmentation, step_matrix(a, lr), 0, n) @ x0
    np.testing.assert_allclose(net.matrix().reshape(-1), expected, rtol=1e-5, atol=1e-5)


def test_rho_matches_a_monte_carlo_average_for_one_fragment() -> None:
    n, d = 5, 4
    g = step_matrix(curvature_matrix(d, "correlated", 0), 0.1)
    sampler = PeerSampler("local", 2, 0)
    moments = Moments.estimate(sampler, n, 50)
    fragmentation = Fragmentation.build(Layout.flat(d), 1, 0)
    u = np.kron(disagreement_basis(n), np.eye(d))
    q = np.kron(np.eye(n) - 1.0 / n, np.eye(d))
    total = sum((q @ round_map(sampler, fragmentation, g, t, n) @ u).T @ (q @ round_map(sampler, fragmentation, g,
                                                                                          t, n) @ u)
                for t in range(50)) / 50
    want = np.linalg.eigvalsh(total)[-1]
    assert rho_after_gossip(moments, g) == pytest.approx(want, rel=1e-9)
    assert rho_after_step(moments, g, fragmentation) == pytest.approx(want, rel=1e-9)


def test_fragments_help_only_with_correlated_curvature() -> None:
    n, d = 8, 8
    moments = Moments.estimate(PeerSampler("local", 2, 0), n, 200)
    frs = [Fragmentation.build(Layout.flat(d), k, 0) for k in (1, 2, 8)]
    g = step_matrix(curvature_matrix(d, "diagonal", 0), 0.05)
    diagonal = [rho_after_step(moments, g, f) for f in frs]
    assert diagonal == pytest.approx([diagonal[0]] * 3, rel=1e-9)
    g = step_matrix(curvature_matrix(d, "correlated", 0), 0.05)
    correlated = [rho_after_step(moments, g, f) for f in frs]
    assert correlated[0] > correlated[1] > correlated[2]
    assert rho_after_gossip(moments, g) == pytest.approx(correlated[0], rel=1e-9)


def test_analyze_writes_table_csv_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = curvature_matrix(6, "correlated", 1)
    np.save(tmp_path / "a.npy", a)
    with pytest.raises(SystemExit) as done:
        main(["analyze", "-n", "6", "-K", "1,3", "--fanout", "2", "--matrix-file", str(tmp_path / "a.npy"),
              "--matrix", "diagonal", "--samples", "30", "--rounds", "4", "--repeats", "1", "--out",
              str(tmp_path / "an")])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "rho_after_step" in out and "file:a.npy" in out
    assert json.loads(out.strip().splitlines()[-1])["out"] == str(tmp_path / "an")
    rows = list(csv.DictReader(open(tmp_path / "an" / "analysis.csv")))
    assert [(r["matrix"], r["K"]) for r in rows] == [("file:a.npy", "1"), ("file:a.npy", "3"), ("diagonal", "1"),
                                                     ("diagonal", "3")]
    assert all(0 < float(r["rho_after_step"]) < 1 and float(r["e_final"]) < float(r["e_0"]) for r in rows)
    curve = list(csv.DictReader(open(tmp_path / "an" / "analysis_rounds.csv")))
    assert len(curve) == 4 * 5
    assert (tmp_path / "an" / "consensus.png").read_bytes()[:4] == b"\x89PNG"


def test_analyze_rejects_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    np.save(tmp_path / "bad.npy", np.arange(16.0).reshape(4, 4))
    for argv, text in [(["--matrix-file", str(tmp_path / "bad.npy")], "symmetric"),
                       (["-n", "4", "--fanout", "4"], "--fanout"),
                       (["-d", "4", "-K", "8"], "--fragments"),
                       (["--matrix", "banded"], "--matrix banded")]:
        with pytest.raises(SystemExit) as stopped:
            main(["analyze", *argv, "--out", str(tmp_path / "x"), "--no-plot", "--rounds", "2"])
        assert stopped.value.code == 1
        assert text in capsys.readouterr().err

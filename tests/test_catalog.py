"""`mergeflow methods` and `mergeflow algorithms`: sorted blocks with whole summaries, inputs and options."""

from __future__ import annotations

import re

from flows.catalog import first_sentence
from flows.cli import main


def _blocks(capsys) -> dict[str, str]:
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100
    blocks = out.strip().split("\n\n")
    names = [block.split()[0] for block in blocks]
    assert names == sorted(names)
    return {name: " ".join(block.split()) for name, block in zip(names, blocks, strict=True)}


def test_methods_are_sorted_with_whole_summaries_inputs_and_options(capsys):
    assert main(["methods"]) == 0
    blocks = _blocks(capsys)
    assert {"average", "regmean", "ssf", "exact", "greedy_soup"} <= set(blocks)
    assert blocks["regmean"].endswith("other parameters averaged. needs: grams options: alpha=0.9")
    assert blocks["greedy_soup"].endswith("needs: scorer")
    assert "needs: fishers uses if given: base, factors options: prior_precision=0.001" in blocks["exact"]
    assert "needs: base options: scaling=0.3" in blocks["task_arithmetic"]
    assert re.search(r"options: .*coefficients=null, by_size=true", blocks["fisher"])
    assert blocks["average"] == "average Uniform average (1/K) Σ θ_k, ignoring data sizes."


def test_algorithms_are_listed_with_their_options(capsys):
    assert main(["algorithms"]) == 0
    blocks = _blocks(capsys)
    assert list(blocks) == ["bayes_admm", "fedadmm", "fedavg", "fedprox"]
    assert blocks["fedprox"].endswith("options: weighting=size, mu=0.01")
    assert "clip_radius=.inf" in blocks["bayes_admm"]


def test_first_sentence_spans_lines_and_stops_at_the_sentence():
    doc = """RegMean: W* per linear layer (``nn.Linear`` and GPT-2's
    ``Conv1D``), other parameters averaged. More detail follows.

    A second paragraph."""
    assert (
        first_sentence(doc) == "RegMean: W* per linear layer (nn.Linear and GPT-2's Conv1D), other parameters averaged."
    )

"""One answer to what a sidecar restart does to its pod's readiness: the sentence the webhook's
``sidecar_container`` docstring states (the injected container has no readinessProbe) is the one
docs/how-to/operate.md and the chart README carry, word for word."""

from __future__ import annotations

import re
from pathlib import Path

from kv_offload_operator.webhook.pod_patch import sidecar_container

REPO = Path(__file__).resolve().parents[1]
DOCS = (REPO / "docs" / "how-to" / "operate.md", REPO / "charts" / "kv-offload" / "README.md")


def flat(text: str) -> str:
    """``text`` with each run of whitespace one space (Markdown wraps lines anywhere)."""
    return re.sub(r"\s+", " ", text)


def restart_sentence() -> str:
    found = re.findall(r"A sidecar restart [^.]*\.", flat(sidecar_container.__doc__ or ""))
    assert len(found) == 1, f"sidecar_container's docstring states one restart sentence, found {found}"
    return found[0]


def test_the_docs_and_the_chart_say_what_the_code_says_a_sidecar_restart_does_to_readiness() -> None:
    sentence = restart_sentence()
    assert "ready endpoints" in sentence
    for doc in DOCS:
        text = flat(doc.read_text())
        assert sentence in text, f"{doc.relative_to(REPO)} must say, word for word: {sentence}"
        about = [s.strip() for s in re.findall(r"[^.]*sidecar restart[^.]*\.", text, re.I)
                 if re.search(r"\bService\b|\bready|readiness", s)]
        others = [s for s in about if s != sentence]
        assert not others, f"{doc.relative_to(REPO)} says something else about a sidecar restart: {others}"

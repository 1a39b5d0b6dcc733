"""benchmarks/batch_draft.py on the CPU: it times both modes and finds that drafting the rows packed
as documents of one row gives each row the drafts it gets alone."""

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import batch_draft  # noqa: E402  (a script directory, not a package)


def test_packed_rows_draft_what_each_row_drafts_alone(capsys):
    batch_draft.main(["--rows", "3", "--context", "12", "--layers", "1", "--iters", "1", "--warmup", "0"])
    out = capsys.readouterr().out
    assert "3 rows of 6-14 context tokens (30 in all), cpu torch.float32" in out
    assert [line.split()[0] for line in out.splitlines() if re.match(r"(packed|one at a time) +[0-9.]+ ", line)] \
        == ["packed", "one"]
    assert "drafts equal: 3 of 3 rows" in out

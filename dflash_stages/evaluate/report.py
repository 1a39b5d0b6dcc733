"""The evaluate report in three forms: report.json, a rich table, and a PNG (τ histogram, and
τ_sim / loss over training steps from the metrics log)."""

from __future__ import annotations

import math
import os
from typing import Any, Mapping, Sequence

from dflash_core.artifacts import write_json


def _num(x: Any, fmt: str = "{:.2f}") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return fmt.format(x)


def clean_json(obj: Any) -> Any:
    """JSON-safe: NaN/inf -> None (json.dumps would write invalid NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): clean_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean_json(v) for v in obj]
    return obj


def write_outputs(report: dict[str, Any], out_dir: str, metrics: Sequence[Mapping[str, Any]] | None = None,
                  plot: bool = True) -> dict[str, str]:
    """report.json and (with ``plot``) report.png in ``out_dir``; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    files = {"json": os.path.join(out_dir, "report.json")}
    if plot:
        files["png"] = plot_report(report, os.path.join(out_dir, "report.png"), metrics)
    report["files"] = files
    write_json(files["json"], clean_json(report))
    return files


def plot_report(report: Mapping[str, Any], path: str, metrics: Sequence[Mapping[str, Any]] | None = None) -> str:
    """τ histogram (drafter vs n-gram, with τ / τ_ngram / τ_sim lines); beside it τ_sim and loss
    over training steps when a metrics log is given."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    recs = [r for r in (metrics or []) if "step" in r]
    ncols = 2 if recs else 1
    fig, axes = plt.subplots(1, ncols, figsize=(6.5 * ncols, 4.2), squeeze=False)
    ax = axes[0][0]
    B = int(report["block_size"])
    xs = list(range(1, B + 1))

    def frac(hist: Sequence[int]) -> list[float]:
        total = sum(hist) or 1
        return [hist[t] / total for t in xs]

    width = 0.4
    ax.bar([x - width / 2 for x in xs], frac(report["tau_histogram"]), width, label="DFlash drafter")
    ng = report.get("ngram")
    if ng:
        ax.bar([x + width / 2 for x in xs], frac(ng["tau_histogram"]), width, label="n-gram baseline", alpha=0.7)
    for value, style, name in ((report.get("tau"), "-", "τ"), (report.get("tau_ngram"), ":", "τ n-gram"),
                               (report.get("tau_sim"), "--", "τ_sim")):
        if value is not None and not (isinstance(value, float) and math.isnan(value)):
            ax.axvline(value, color="k", linestyle=style, linewidth=1, label=f"{name} = {value:.2f}")
    ax.set_xlabel("τ per cycle (accepted drafts + 1)")
    ax.set_ylabel("fraction of cycles")
    title = f"acceptance, step {report.get('step')}" if report.get("step") is not None else "acceptance"
    if report.get("gap_flag"):
        title += f"  — GAP {report['gap'] * 100:+.0f}%"
    ax.set_title(title, color="red" if report.get("gap_flag") or not report.get("lossless", True) else "black")
    ax.set_xticks(xs)
    ax.legend(fontsize=8)
    if recs:
        ax2 = axes[0][1]
        steps = [r["step"] for r in recs]
        if any(r.get("tau_sim") is not None for r in recs):
            ax2.plot(steps, [r.get("tau_sim") for r in recs], color="tab:blue", label="τ_sim (train)")
        if report.get("tau") is not None and report.get("step") is not None:
            ax2.scatter([report["step"]], [report["tau"]], color="tab:red", zorder=3, label="served τ")
        ax2.set_xlabel("step")
        ax2.set_ylabel("τ_sim", color="tab:blue")
        ax3 = ax2.twinx()
        if any(r.get("loss") is not None for r in recs):
            ax3.plot(steps, [r.get("loss") for r in recs], color="tab:orange", alpha=0.7, label="loss")
        ax3.set_ylabel("loss", color="tab:orange")
        ax2.set_title("training")
        ax2.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render_table(report: Mapping[str, Any]) -> Any:
    """A rich renderable: headline figures, per-prompt rows, warning lines."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = Table(title=f"speculative decoding — {report.get('export') or 'drafter'}", show_header=True)
    for col in ("", "DFlash", "n-gram"):
        head.add_column(col, justify="right" if col else "left")
    ng = report.get("ngram") or {}
    head.add_row("τ (served, mean per cycle)", _num(report.get("tau")), _num(report.get("tau_ngram")))
    vs = report.get("vs_ngram")
    if vs:
        head.add_row("τ − n-gram τ (± its s.e. over prompts; prompts won / lost)",
                     f"{vs['diff']:+.2f} ± {vs['se']:.2f} ({vs['wins']} / {vs['losses']})", "")
    head.add_row("τ_sim (teacher-forced, the served blocks)", _num(report.get("tau_sim")), "")
    head.add_row("τ_ref (a decode of the greedy reference: one text for the drafters that share it)",
                 _num(report.get("tau_ref")), "")
    head.add_row("τ_sim (teacher-forced, every anchor)", _num(report.get("tau_sim_all")), "")
    head.add_row("τ_serve (every anchor, harmonic: what a decode makes)", _num(report.get("tau_serve_all")), "")
    if report.get("training"):
        head.add_row("τ_sim (last training log)", _num(report["training"].get("tau_sim_train")), "")
        head.add_row("τ_serve (last training log)", _num(report["training"].get("tau_serve_train")), "")
        if report["training"].get("tau_serve_val") is not None:
            head.add_row("τ_serve (training's validation documents, walked over the last epoch)",
                         _num(report["training"]["tau_serve_val"]), "")
    gap = report.get("gap")
    head.add_row("gap (τ_sim − τ) / τ_sim",
                 Text(_num(gap * 100 if gap is not None else None, "{:+.1f}%"),
                      style="bold red" if report.get("gap_flag") else ""), "")
    head.add_row("drafted / accepted tokens", f"{report.get('drafted')} / {report.get('accepted')}",
                 f"{ng.get('drafted', '-')} / {ng.get('accepted', '-')}")
    head.add_row("cycles", str(report.get("cycles")), str(ng.get("cycles", "-")))
    ties = len(report.get("near_ties") or [])
    head.add_row("lossless (= target greedy)",
                 Text(("yes" if report.get("lossless") else "NO") + (f", {ties} near ties" if ties else ""),
                      style="green" if report.get("lossless") else "bold red"),
                 "")
    tp = report.get("throughput") or {}
    if tp:
        greedy = _num(tp.get("greedy_tokens_per_s"), "{:.0f}")
        made = (report.get("timing") or {}).get("baseline_step")
        during = made not in (None, report.get("step"))
        when = f"; HF greedy and n-gram at step {made}, during training" if during else ""
        head.add_row(f"tokens/s (batch {tp.get('batch_size')}; HF greedy {greedy}{when})",
                     _num(tp.get("spec_tokens_per_s"), "{:.0f}"), _num(ng.get("tokens_per_s"), "{:.0f}"))
    hist = report.get("tau_histogram") or []
    head.add_row("τ histogram 1..B", " ".join(str(h) for h in hist[1:]),
                 " ".join(str(h) for h in ng.get("tau_histogram", [])[1:]))
    parts: list[Any] = [head]
    if report.get("ngram_split"):
        parts.append(split_table(report))
    rows = report.get("per_prompt") or []
    if rows:
        t = Table(title="per prompt", show_header=True)
        for col in ("#", "prompt tok", "generated", "τ", "τ n-gram", "τ_sim", "drafted", "accepted", "lossless"):
            t.add_column(col, justify="right")
        for r in rows:
            t.add_row(str(r["index"]), str(r["prompt_tokens"]), str(r["generated"]), _num(r.get("tau")),
                      _num(r.get("tau_ngram")), _num(r.get("tau_sim")), str(r["drafted"]), str(r["accepted"]),
                      "yes" if r.get("lossless") else "NO")
        parts.append(t)
    for line in report.get("warnings") or []:
        parts.append(Text(f"WARNING: {line}", style="bold red"))
    files = report.get("files") or {}
    if files:
        parts.append(Text("report: " + ", ".join(files.values()), style="dim"))
    return Group(*parts)


def split_table(report: Mapping[str, Any]) -> Any:
    """The cycles of each drafter by whether the n-gram drafter has a match where they start
    (``ngram_split``): τ on text n-gram could copy against τ on new text."""
    from rich.table import Table

    split = report["ngram_split"]
    t = Table(title="where τ is won or lost: cycles by the n-gram drafter's match at their start", show_header=True)
    for col in ("", "DFlash cycles", "DFlash τ", "DFlash % tokens", "n-gram cycles", "n-gram τ", "n-gram % tokens"):
        t.add_column(col, justify="right" if col else "left")

    def cells(part: Mapping[str, Any] | None) -> list[str]:
        if not part:
            return ["-", "-", "-"]
        share = part["share"]
        return [str(part["cycles"]), _num(part["tau"]), _num(share * 100 if share is not None else None, "{:.0f}%")]

    def row(name: str, part: Mapping[str, Any]) -> None:
        t.add_row(name, *cells(part["dflash"]), *cells(part["ngram"]))

    row("n-gram match (copyable text)", split["match"])
    for n, part in split["match_length"].items():
        row(f"  suffix of {n} token{'s' if n != '1' else ''}", part)
    row("no n-gram match (new text)", split["no_match"])
    ng = report.get("ngram") or {}
    t.add_row("all cycles", str(report.get("cycles")), _num(report.get("tau_all")), "100%",
              str(ng.get("cycles", "-")), _num(ng.get("tau_all")), "100%" if ng else "-")
    return t


def summary_table(summary: Mapping[str, Any]) -> Any:
    """The end-of-run table of the stage (from ctx.summary)."""
    from rich.table import Table

    t = Table(title="evaluate", show_header=True)
    for col in ("step", "τ", "τ n-gram", "τ_sim", "τ_ref", "gap", "lossless"):
        t.add_column(col, justify="right")
    gap = summary.get("gap")
    t.add_row(str(summary.get("step")), _num(summary.get("tau")), _num(summary.get("tau_ngram")),
              _num(summary.get("tau_sim")), _num(summary.get("tau_ref")),
              (_num(gap * 100, "{:+.0f}%") if gap is not None else "-") + (" FLAG" if summary.get("gap_flag") else ""),
              "yes" if summary.get("lossless") else "NO")
    return t

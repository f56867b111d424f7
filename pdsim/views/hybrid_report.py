"""The report of `pdsim study-hybrid`: the bytes a request hands off per model (a hybrid beside
its all-full twin and the dense reference), and overlap's tokens/s gain over whole copy, as a
figure per engine, tables and findings read off the rows; the demo shows its short form."""

from __future__ import annotations

import csv
import io

from pdsim.core.twins import ALL_FULL
from pdsim.views.plots import _png, plt

COLORS = ("tab:gray", "tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown")
CSV_COLUMNS = ("hw", "engine", "model", "mode", "prompt", "concurrency", "bytes_per_request",
               "bytes_per_token", "twin_bytes_ratio", "prefill_s", "tail_mean_s",
               "tail_share_pct", "handoff_p50_s", "handoff_change_pct", "tokens_per_s",
               "gain_pct", "ttft_p50_s", "decode_batch_mean", "trace")


def png_name(engine: str) -> str:
    return f"study-hybrid-{engine}.png"


def hybrid_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, extrasaction="ignore",
                            lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def _pick(rows: list[dict], **match) -> list[dict]:
    """The rows whose fields equal `match`, by prompt."""
    return sorted((r for r in rows if all(r[k] == v for k, v in match.items())),
                  key=lambda r: r["prompt"])


def _models(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["model"] for r in rows))


def _style(models: list[str], model: str) -> dict:
    """A base model's color; its twin the same color, dashed."""
    bases = list(dict.fromkeys(m.removesuffix(ALL_FULL) for m in models))
    color = COLORS[bases.index(model.removesuffix(ALL_FULL)) % len(COLORS)]
    twin = model.endswith(ALL_FULL)
    return dict(color=color, ls="--" if twin else "-", marker="s" if twin else "o", ms=3,
                label=model)


PANELS = (("bytes_per_request", "whole", "handed off per request, MiB", 2.0 ** -20),
          ("tail_share_pct", "whole", "whole copy's tail, % of prefill", 1.0),
          ("gain_pct", "chunk", "chunk vs whole, tokens/s %", 1.0),
          ("gain_pct", "layer", "layer vs whole, tokens/s %", 1.0))


def hybrid_png(rows: list[dict], engine: str) -> bytes:
    """A column per device, a row per panel (PANELS) against the prompt, at the lowest
    concurrency: each model a color, each hybrid's all-full twin dashed."""
    rows = [r for r in rows if r["engine"] == engine]
    hws, models = list(dict.fromkeys(r["hw"] for r in rows)), _models(rows)
    c = min(r["concurrency"] for r in rows)
    fig, grid = plt.subplots(len(PANELS), len(hws), figsize=(5.2 * len(hws), 11),
                             squeeze=False)
    for col, hw in enumerate(hws):
        for row, (key, mode, label, scale) in enumerate(PANELS):
            ax = grid[row][col]
            for model in models:
                data = _pick(rows, hw=hw, model=model, mode=mode, concurrency=c)
                ax.plot([r["prompt"] for r in data], [r[key] * scale for r in data],
                        **_style(models, model))
            ax.set_xscale("log", base=2)
            if key == "bytes_per_request":
                ax.set_yscale("log", base=2)
            else:
                ax.axhline(0.0, color="gray", lw=0.8)
            ax.set_xlabel("prompt, tokens")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        grid[0][col].set_title(f"{hw} under {engine}, C={c}")
    grid[0][0].legend(fontsize=7)
    fig.suptitle("pdsim study-hybrid: a hybrid's handoff and overlap's gain (dashed: the same "
                 "model with every layer full)")
    fig.tight_layout()
    return _png(fig)


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.0f}"


def bytes_table(rows: list[dict]) -> list[str]:
    """Per model, MiB handed off per request at each prompt (÷ its twin's: how many times
    less), and bytes per prompt token at the longest prompt against the first model's."""
    first = rows[0]
    one = [r for r in rows if (r["hw"], r["engine"], r["concurrency"], r["mode"])
           == (first["hw"], first["engine"], first["concurrency"], "whole")]
    prompts = sorted({r["prompt"] for r in one})
    models = _models(one)
    ref = {r["prompt"]: r for r in _pick(one, model=models[0])}
    lines = ["| model | " + " | ".join(f"{p:,} tokens" for p in prompts)
             + f" | per token at {prompts[-1]:,} | vs {models[0]} |", "|---" * (len(prompts) + 3)
             + "|"]
    for model in models:
        data = _pick(one, model=model)
        cells = [_mib(r["bytes_per_request"]) + (f" (÷{r['twin_bytes_ratio']:.1f})"
                                                  if r["twin_bytes_ratio"] else "")
                 for r in data]
        last = data[-1]
        vs = last["bytes_per_request"] / ref[last["prompt"]]["bytes_per_request"]
        lines.append(f"| {model} | " + " | ".join(cells)
                     + f" | {last['bytes_per_token']:,.0f} B | x{vs:.2f} |")
    return lines


def _changes(rows: list[dict], key: str, **at) -> str:
    """Chunk's and layer's `key` (a change in percent) at one point."""
    return ", ".join(f"{_pick(rows, mode=m, **at)[0][key]:+.1f}%" for m in ("chunk", "layer"))


def gain_table(rows: list[dict], hw: str, engine: str) -> list[str]:
    """Per model and prompt: prefill, whole copy's tail, each mode's tokens/s gain (every
    concurrency) and handoff change (the lowest)."""
    mine = [r for r in rows if (r["hw"], r["engine"]) == (hw, engine)]
    cs = sorted({r["concurrency"] for r in mine})
    head = " | ".join(f"chunk, layer tokens/s (C={c})" for c in cs)
    lines = [f"| model | prompt | prefill | whole tail (C={cs[0]}) | {head} | "
             f"chunk, layer handoff p50 (C={cs[0]}) |", "|---" * (len(cs) + 5) + "|"]
    for model in _models(mine):
        for w in _pick(mine, model=model, mode="whole", concurrency=cs[0]):
            at = dict(model=model, prompt=w["prompt"])
            gains = [_changes(mine, "gain_pct", concurrency=c, **at) for c in cs]
            handoff = _changes(mine, "handoff_change_pct", concurrency=cs[0], **at)
            lines.append(f"| {model} | {w['prompt']:,} | {w['prefill_s'] * 1e3:,.0f} ms | "
                         f"{w['tail_mean_s'] * 1e3:.1f} ms ({w['tail_share_pct']:.1f}%) | "
                         + " | ".join(gains) + f" | {handoff} |")
    return lines


def _spread(values: list[float], unit: str = "%", sign: str = "+") -> str:
    return f"{min(values):{sign}.1f}{unit}..{max(values):{sign}.1f}{unit}"


def bytes_words(rows: list[dict]) -> list[str]:
    """Each hybrid's handoff against its twin's and the first (dense) model's, in words."""
    first = rows[0]
    one = _pick(rows, hw=first["hw"], engine=first["engine"], mode="whole",
                concurrency=first["concurrency"])
    ref, longest = _models(one)[0], one[-1]["prompt"]
    per_token = {r["model"]: r["bytes_per_token"] for r in one if r["prompt"] == longest}
    out = []
    for model in _models(one):
        ratios = [r["twin_bytes_ratio"] for r in one if r["model"] == model
                  and r["twin_bytes_ratio"]]
        if ratios:
            out.append(f"- {model} hands off {_spread(ratios, 'x', '')} less than the same "
                       f"model with every layer full ({one[0]['prompt']:,}..{longest:,} "
                       f"tokens); at {longest:,} tokens {per_token[model]:,.0f} B per prompt "
                       f"token, x{per_token[model] / per_token[ref]:.2f} of {ref}'s.")
    return out


def overlap_table(rows: list[dict]) -> list[str]:
    """Per device, engine and model at the lowest concurrency, over the prompts: whole copy's
    tail as a share of the prefill, and chunk's and layer's tokens/s change over whole."""
    c = min(r["concurrency"] for r in rows)
    lines = [f"| model | device | engine | whole tail / prefill (C={c}) | chunk vs whole | "
             "layer vs whole |", "|---" * 6 + "|"]
    for hw, engine in dict.fromkeys((r["hw"], r["engine"]) for r in rows):
        for model in _models(rows):
            at = [r for r in rows if (r["hw"], r["engine"], r["model"], r["concurrency"])
                  == (hw, engine, model, c)]
            tails = [r["tail_share_pct"] for r in at if r["mode"] == "whole"]
            gains = [_spread([r["gain_pct"] for r in at if r["mode"] == m])
                     for m in ("chunk", "layer")]
            lines.append(f"| {model} | {hw} | {engine} | {_spread(tails, '%', '')} | "
                         + " | ".join(gains) + " |")
    return lines


def gain_words(rows: list[dict]) -> list[str]:
    """Per device and engine: each model's chunk and layer tokens/s change over whole copy
    at each concurrency, and whole copy's tail as a share of the prefill."""
    cs = sorted({r["concurrency"] for r in rows})
    out = []
    for hw, engine in dict.fromkeys((r["hw"], r["engine"]) for r in rows):
        mine = [r for r in rows if (r["hw"], r["engine"]) == (hw, engine)]
        for c in cs:
            parts = []
            for model in _models(mine):
                at = [r for r in mine if (r["model"], r["concurrency"]) == (model, c)]
                gains = ", ".join(f"{mode} " + _spread([r["gain_pct"] for r in at
                                                         if r["mode"] == mode])
                                  for mode in ("chunk", "layer"))
                tails = [r["tail_share_pct"] for r in at if r["mode"] == "whole"]
                parts.append(f"{model} {gains}" + (
                    f" (whole tail {_spread(tails, '%', '')} of the prefill)" if c == cs[0]
                    else ""))
            out.append(f"- {hw} under {engine}, C={c}, tokens/s vs whole: "
                       + "; ".join(parts) + ".")
    worst = min((r for r in rows if r["mode"] != "whole"), key=lambda r: r["gain_pct"])
    if worst["gain_pct"] < 0:
        out.append(f"- The largest loss: {worst['model']} in {worst['mode']} mode, "
                   f"{worst['prompt']:,} tokens, C={worst['concurrency']}, {worst['hw']} under "
                   f"{worst['engine']}: {worst['gain_pct']:+.1f}%.")
    return out


def report_text(rows: list[dict], grid, checks: list) -> str:
    lines = [
        "# pdsim study-hybrid: how much smaller is a hybrid's handoff, and does overlap "
        "still pay?", "",
        f"Devices {', '.join(grid.hws)} (each profile's link), engines "
        f"{', '.join(grid.engines)}, models {', '.join(grid.with_twins())} (NAME+full: the "
        "same model with every layer full attention, what its layer kinds are compared "
        f"with); prompts {', '.join(f'{p:,}' for p in grid.prompts)} tokens; closed loop of "
        f"{grid.requests} requests at C = {', '.join(map(str, grid.concurrencies))}, "
        f"{grid.output_tokens} output tokens each, chunk {grid.chunk}, pdgpu serve's queued "
        "sender and two-prompt source cache (as `pdsim study`). Gain = a mode's tokens/s over "
        "whole copy's. The model's answers, not measurements.", "",
        "## How much smaller is the handoff", "",
        "MiB handed off per request (÷N: N times less than the model's all-full twin):", "",
        *bytes_table(rows), "", *bytes_words(rows), "", "## Does overlap still pay?", "",
        "Tokens/s of chunk and layer mode over whole copy, over the prompts:", "",
        *overlap_table(rows), "", *gain_words(rows), "", WHY, ""]
    for engine in grid.engines:
        lines += [f"![study-hybrid under {engine}]({png_name(engine)})", ""]
    for hw, engine in dict.fromkeys((r["hw"], r["engine"]) for r in rows):
        lines += [f"### {hw} under {engine}", "", *gain_table(rows, hw, engine), ""]
    lines += ["## Traces", "", "`pdref check` of each hybrid's run at the longest prompt:", ""]
    lines += [f"- `{c.file.split('/')[-1]}`: {'legal' if c.ok else 'REFUSED ' + str(c.code)}, "
              f"{c.events:,} events" for c in checks]
    lines += ["", "Every row: `hybrid.csv`. Reproduce: `pdsim study-hybrid --out DIR`.", ""]
    return "\n".join(lines)


WHY = ("Why, in the model: overlap can only remove whole copy's tail, the copy left after "
       "the last chunk, and that pays in tokens/s while the loop waits for it (one request "
       "at a time). A hybrid hands off less (a linear layer's state does not grow with the "
       "prompt, a sliding layer sends its window), while its compute is its size's: its "
       "tail is a small share of its prefill, and so is what overlap can win. The all-full "
       "twins show how much of that is the layer kinds and how much the model's size "
       "(27B of compute per token against qwen3-0.6b's 0.6B). With several requests "
       "and pdgpu serve's two-prompt source cache the next prefill can hide whole copy's "
       "tail instead (`pdsim study`).")

"""Draw Chrome traces written by the engine (`trace_path=`) as a PNG timeline, several one above the
other (e.g. plain loop vs overlap), so a person can see the device's bubbles. Uses Pillow only.

    python -m gapless.bench.timeline plain.json overlap.json -o timeline.png          # the whole run
    python -m gapless.bench.timeline plain.json overlap.json --skip-ms 200 --ms 60   # a close-up
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from PIL import Image, ImageDraw

COLORS = {
    "schedule": (66, 133, 244),
    "launch": (140, 170, 240),
    "process": (251, 188, 5),
    "extend": (219, 68, 55),
    "decode": (15, 157, 88),
}
ROW_H, GAP, LEFT, WIDTH = 28, 10, 150, 1400


def load_spans(path: str | Path) -> dict[str, list[tuple[str, float, float]]]:
    """track name -> [(span name, start ms, end ms)], times relative to the first span."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M"}
    tracks: dict[str, list[tuple[str, float, float]]] = {n: [] for n in names.values()}
    for e in events:
        if e.get("ph") == "X":
            tracks[names[e["tid"]]].append((e["name"], e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3))
    return tracks


def draw(
    traces: list[tuple[str, str | Path]],
    out: str | Path,
    window_ms: float | None = None,
    skip_ms: float = 0.0,
) -> float:
    """One panel per (title, trace file): host and device rows over the same `window_ms`, starting
    `skip_ms` into each trace (past warm-up). With no window, it spans the longest trace from `skip_ms`
    to its end, so the default picture shows the whole run. Returns the window drawn, in ms."""
    loaded = [(title, load_spans(path)) for title, path in traces]
    if window_ms is None:
        ends = [e for _, tracks in loaded for spans in tracks.values() for _, _, e in spans]
        window_ms = max(max(ends, default=0.0) - skip_ms, 1.0)
    panel_h = 22 + 2 * (ROW_H + GAP)
    img = Image.new("RGB", (LEFT + WIDTH + 20, 30 + panel_h * len(traces) + 30), "white")
    d = ImageDraw.Draw(img)
    scale = WIDTH / window_ms
    y = 10
    for title, tracks in loaded:
        d.text((10, y), title, fill="black")
        y += 20
        for track in ("host", "device"):
            d.text((10, y + 8), track, fill="black")
            d.rectangle([LEFT, y, LEFT + WIDTH, y + ROW_H], outline=(200, 200, 200))
            for name, s, e in tracks.get(track, []):
                s, e = s - skip_ms, e - skip_ms
                if e < 0 or s > window_ms:
                    continue
                x0, x1 = LEFT + max(0.0, s) * scale, LEFT + min(window_ms, e) * scale
                d.rectangle(
                    [x0, y + 2, max(x0 + 1, x1), y + ROW_H - 2], fill=COLORS.get(name, (120, 120, 120))
                )
            y += ROW_H + GAP
    legend_x = LEFT
    for name, color in COLORS.items():
        d.rectangle([legend_x, y + 4, legend_x + 12, y + 16], fill=color)
        d.text((legend_x + 16, y + 4), name, fill="black")
        legend_x += 110
    d.text((LEFT + WIDTH - 160, y + 4), f"window {window_ms:g} ms", fill="black")
    img.save(out)
    return window_ms


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", help="trace JSON files (title = file stem)")
    ap.add_argument("-o", "--out", default="timeline.png")
    ap.add_argument("--ms", type=float, default=None, help="window length (default: the whole run)")
    ap.add_argument("--skip-ms", type=float, default=0.0, help="start this far into each trace")
    args = ap.parse_args(argv)
    window = draw([(Path(t).stem, t) for t in args.traces], args.out, args.ms, args.skip_ms)
    print(f"wrote {args.out} ({window:.1f} ms)")


if __name__ == "__main__":
    main()

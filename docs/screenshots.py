"""Photograph the report, the comparison and the dataset viewer in headless Chromium for the docs.

    python docs/screenshots.py --report RUN --compare COMPARE_DIR --viewer PROCESS_DIR [--out docs]

RUN is a folder written by `blackjack-rl evaluate`, COMPARE_DIR one written by
`blackjack-rl compare`, PROCESS_DIR one written by `blackjack-rl process`. See
docs/report.md for the commands that made the pictures in the README.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from blackjack_rl.report.chromium import browser_context


def _open(context, path: Path, ready: str | None = None):
    page = context.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.resolve().as_uri())
    if ready:
        page.wait_for_selector(ready, state="attached", timeout=30_000)
    if errors:
        raise SystemExit(f"{path} logged errors: {errors}")
    return page


def _clip_until(page, selector: str, out: Path, top: str = "body") -> None:
    """Screenshot from the top of the page down to the end of `selector`."""
    box = page.locator(selector).bounding_box()
    page.screenshot(path=str(out), full_page=True, clip={"x": 0, "y": 0, "width": 1280, "height": box["y"] + box["height"] + 16})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", type=Path, required=True, help="an evaluation folder (report.html)")
    parser.add_argument("--compare", type=Path, required=True, help="a compare folder (compare.html)")
    parser.add_argument("--viewer", type=Path, required=True, help="a process folder (groups.html)")
    parser.add_argument("--also", action="append", default=[], metavar="NAME=RUN",
                        help="another evaluation folder whose report goes to NAME.png")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with browser_context(width=1280, height=900) as context:
        page = _open(context, args.report / "report.html")
        _clip_until(page, "#strategy", args.out / "report.png")
        page.locator("#heatmaps").screenshot(path=str(args.out / "report-mistakes.png"))
        page.close()

        extra = []
        for item in args.also:
            name, _, run = item.partition("=")
            page = _open(context, Path(run) / "report.html")
            _clip_until(page, "#strategy", args.out / f"{name}.png")
            page.close()
            extra.append(f"{name}.png")

        page = _open(context, args.compare / "compare.html")
        _clip_until(page, "section.comparison table.diffs", args.out / "compare.png")
        page.close()

        page = _open(context, args.viewer / "groups.html", ready="body[data-ready]")
        first = page.locator("details.tokens").first
        first.locator("summary").click()
        page.wait_for_selector("details.tokens .tok span")
        # the model's own (trained) tokens come last: show them, not the system prompt
        page.eval_on_selector("details.tokens .tok", "el => { el.scrollTop = el.scrollHeight; }")
        page.set_viewport_size({"width": 1280, "height": 1000})
        page.screenshot(path=str(args.out / "viewer.png"))
        page.close()
    for name in ["report.png", "report-mistakes.png", "compare.png", "viewer.png", *extra]:
        print(args.out / name)


if __name__ == "__main__":
    main()

"""plot.py: the run's curves as a PNG, with numpy and zlib only (no plotting library is a
dependency).

save_curves(history, path) draws two panels over steps: training reward (mean rollout reward per
step) and held-out accuracy (at each eval). Both are rewards in [0, 1], so the y axes are fixed to
[0, 1]. Text uses a 3x5 pixel font scaled up; enough for titles and tick labels.
Imports: none of our files (numpy, the standard library).
"""

import struct
import zlib

import numpy as np

# 3x5 glyphs, rows top to bottom, '#' = ink
_FONT = {
    "0": "#### ## ## ####",
    "1": " # ##  #  # ###",
    "2": "###  #####  ###",
    "3": "###  ####  ####",
    "4": "# ## ####  #  #",
    "5": "####  ###  ####",
    "6": "####  #### ####",
    "7": "###  #  #  #  #",
    "8": "#### ##### ####",
    "9": "#### ####  ####",
    ".": "             # ",
    " ": "               ",
    "-": "      ###      ",
    "A": " # # ##### ## #",
    "C": "####  #  #  ###",
    "D": "## # ## ## ### ",
    "E": "####  ####  ###",
    "G": "####  # ## ####",
    "H": "# ## ##### ## #",
    "I": "### #  #  # ###",
    "K": "# ### #  ## # #",
    "L": "#  #  #  #  ###",
    "N": "## # ## ## ## #",
    "O": "#### ## ## ####",
    "P": "#### #####  #  ",
    "R": "## # ### # ## #",
    "S": "####  ###  ####",
    "T": "### #  #  #  # ",
    "U": "# ## ## ## ####",
    "V": "# ## ## ## # # ",
    "W": "# ## ## ##### #",
    "Y": "# ## # #  #  # ",
}


def _text(img, x, y, s, color, scale=2):
    for ch in s.upper():
        g = _FONT.get(ch, _FONT[" "])
        for i, c in enumerate(g):
            if c == "#":
                r, q = divmod(i, 3)
                img[y + r * scale : y + (r + 1) * scale, x + q * scale : x + (q + 1) * scale] = (
                    color
                )
        x += 4 * scale


def _line(img, x0, y0, x1, y1, color, width=2):
    n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
    for t in np.linspace(0, 1, n):
        x, y = int(round(x0 + t * (x1 - x0))), int(round(y0 + t * (y1 - y0)))
        img[
            max(y - width // 2, 0) : y + width - width // 2,
            max(x - width // 2, 0) : x + width - width // 2,
        ] = color


def _panel(img, top, title, points, max_step, color):
    """One 0..1 panel at pixel row `top`: frame, grid at quarters, tick labels, the curve."""
    # the frame, in pixels: its left edge, width and height
    left = 60
    width = img.shape[1] - 80
    height = 180
    _text(img, left, top - 18, title, (0, 0, 0))
    for q in range(5):
        y = top + height - int(q / 4 * height)
        img[y, left : left + width] = (220, 220, 220) if q not in (0, 4) else (0, 0, 0)
        if q % 2 == 0:
            _text(img, 10, y - 5, f"{q / 4:.1f}", (0, 0, 0))
    img[top : top + height + 1, left] = (0, 0, 0)
    img[top : top + height + 1, left + width] = (0, 0, 0)
    _text(img, left, top + height + 8, "0", (0, 0, 0))
    _text(img, left + width - 40, top + height + 8, f"{max_step}", (0, 0, 0))
    _text(img, left + width // 2 - 20, top + height + 8, "STEP", (0, 0, 0))
    xy = [
        (left + int(s / max(max_step, 1) * width), top + height - int(min(max(v, 0), 1) * height))
        for s, v in points
    ]
    for (x0, y0), (x1, y1) in zip(xy, xy[1:]):
        _line(img, x0, y0, x1, y1, color)
    for x, y in xy:
        img[y - 2 : y + 3, x - 2 : x + 3] = color


def _write_png(img: np.ndarray, path: str) -> None:
    """Minimal PNG writer: 8-bit RGB, filter 0 on every row, one IDAT chunk."""
    h, w, _ = img.shape
    raw = b"".join(b"\x00" + img[y].astype(np.uint8).tobytes() for y in range(h))

    def chunk(kind, data):
        return (
            struct.pack(">I", len(data))
            + kind
            + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )

    with open(path, "wb") as f:
        f.write(
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9))
            + chunk(b"IEND", b"")
        )


def save_curves(history: list[tuple[int, dict]], path: str) -> None:
    """history: (step, metrics) pairs as train.py logs them."""
    img = np.full((520, 720, 3), 255, dtype=np.uint8)  # (H, W, RGB)
    max_step = max([s for s, _ in history] + [1])
    reward = [(s, m["rollout/reward"]) for s, m in history if "rollout/reward" in m]
    acc = [(s, m["eval/accuracy"]) for s, m in history if "eval/accuracy" in m]
    _panel(img, 30, "TRAINING REWARD", reward, max_step, (31, 119, 180))
    _panel(img, 290, "HELD-OUT ACCURACY", acc, max_step, (214, 39, 40))
    _write_png(img, path)

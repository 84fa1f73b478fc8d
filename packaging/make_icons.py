"""Renders the app icon, resources/icons/expertstream.svg, into the formats bundles need:

    expertstream.png    512 px, the Linux .desktop / AppImage icon
    expertstream.icns   macOS .app icon (16 to 1024 px)
    expertstream.ico    Windows executable icon (16 to 256 px)

Run after changing the SVG (needs PySide6 and Pillow):  python packaging/make_icons.py
"""

import io
import sys
from pathlib import Path

from PIL import Image
from PySide6.QtCore import QBuffer, QIODevice, Qt
from PySide6.QtGui import QGuiApplication, QImage, QPainter
from PySide6.QtSvg import QSvgRenderer

ICONS = Path(__file__).resolve().parent.parent / "resources" / "icons"
ICNS_SIZES = (16, 32, 64, 128, 256, 512, 1024)
ICO_SIZES = (16, 24, 32, 48, 64, 128, 256)


def render(svg: Path, size: int) -> Image.Image:
    """The SVG drawn at size x size pixels, antialiased, on a transparent background."""
    renderer = QSvgRenderer(str(svg))
    if not renderer.isValid():
        raise ValueError(f"{svg}: not a valid SVG")
    image = QImage(size, size, QImage.Format.Format_ARGB32)
    image.fill(Qt.GlobalColor.transparent)
    painter = QPainter(image)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    renderer.render(painter)
    painter.end()
    buf = QBuffer()
    buf.open(QIODevice.OpenModeFlag.WriteOnly)
    image.save(buf, "PNG")
    return Image.open(io.BytesIO(bytes(buf.data()))).convert("RGBA")


def main() -> int:
    QGuiApplication.instance() or QGuiApplication(["make_icons", "-platform", "offscreen"])
    svg = ICONS / "expertstream.svg"
    render(svg, 512).save(ICONS / "expertstream.png", optimize=True)
    big = render(svg, 1024)
    big.save(ICONS / "expertstream.icns", append_images=[render(svg, s) for s in ICNS_SIZES])
    render(svg, 256).save(ICONS / "expertstream.ico", sizes=[(s, s) for s in ICO_SIZES])
    for name in ("expertstream.png", "expertstream.icns", "expertstream.ico"):
        print(f"wrote {ICONS / name} ({(ICONS / name).stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

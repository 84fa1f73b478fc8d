"""Entry point of the desktop bundle's one executable.

Started as `expertstream-gui` (or by double-click) it runs the desktop app; started through
the `expertstream` link next to it, the command line. One executable keeps one copy of the
frozen Python modules in the bundle.
"""

import os
import sys


def main() -> int:
    if os.path.basename(sys.argv[0]).lower() in ("expertstream", "expertstream.exe"):
        from engine.cli import main as cli_main

        return cli_main()
    from app.main import main as gui_main

    return gui_main()


if __name__ == "__main__":
    sys.exit(main())

#!/bin/sh
# Puts ExpertStream in your desktop's application menu, for you only (nothing system-wide):
# a menu entry that starts expertstream-gui from this folder, and the app's icon.
# Run it again after moving the folder; `./install-desktop-entry.sh --remove` takes both away.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
data=${XDG_DATA_HOME:-$HOME/.local/share}
entry=$data/applications/expertstream.desktop
icon=$data/icons/hicolor/512x512/apps/expertstream.png

if [ "${1:-}" = --remove ]; then
  rm -f "$entry" "$icon"
  echo "removed $entry and $icon"
  exit 0
fi
case $here in
  *[\"\`\$\\]*) echo "install-desktop-entry.sh: move the folder to a path without \" \` \$ or \\ first" >&2; exit 1 ;;
esac
mkdir -p "$(dirname "$entry")" "$(dirname "$icon")"
cp "$here/expertstream.png" "$icon"
{
  grep -v '^Exec=' "$here/expertstream.desktop"
  printf 'Exec="%s/expertstream-gui"\n' "$here"
} > "$entry"
if command -v update-desktop-database >/dev/null; then
  update-desktop-database -q "$data/applications" || true
fi
echo "added $entry: ExpertStream is in your application menu"

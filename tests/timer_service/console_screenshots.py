"""Take the console's screenshots for the docs: ``uv run python -m
tests.timer_service.console_screenshots docs/images`` (needs the distribution's chromium).

The same rig and browser driver as the browser tests: a worker with one quarantined timer,
signed in so the action buttons show, at 1280 and 390 px.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
from pathlib import Path

from tests.timer_service.browser import chromium
from tests.timer_service.console_rig import POISON, TOKEN, console_rig

SHOTS = [
    ("overview", "/console"),
    ("timer", f"/console/timer?tenant=tenant-a&call={POISON}"),
    ("quarantine", "/console/quarantine"),
]


async def take(out: Path) -> None:
    executable = shutil.which("chromium")
    if executable is None:
        raise SystemExit("needs chromium (apt-get install chromium)")
    with tempfile.TemporaryDirectory() as profile, chromium(executable, Path(profile)) as browser:
        async with console_rig() as console, browser.tab() as tab:
            await tab.open(console.base + "/console/sign-in")
            await tab.type_into("#f-token", TOKEN)
            async with tab.loading():
                await tab.press("Enter")
            for width, height in ((1280, 800), (390, 844)):
                await tab.viewport(width, height)
                for name, path in SHOTS:
                    await tab.open(console.base + path)
                    target = out / f"console-{name}-{width}.png"
                    target.write_bytes(await tab.screenshot())
                    print(target)


if __name__ == "__main__":
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/images")
    folder.mkdir(parents=True, exist_ok=True)
    asyncio.run(take(folder))

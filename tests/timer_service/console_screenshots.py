"""Take the console's screenshots for the docs: ``uv run python -m
tests.timer_service.console_screenshots docs/images`` (needs the distribution's chromium).

The same rig and browser facade as the browser tests: a worker with one quarantined timer,
signed in so the action buttons show, at 1280 and 390 px.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
from pathlib import Path

from tests.docs.browser import chromium
from tests.timer_service.console_browser import open_page, sign_in
from tests.timer_service.console_rig import POISON, console_rig

SHOTS = [
    ("overview", "/console"),
    ("timer", f"/console/timer?tenant=tenant-a&call={POISON}"),
    ("quarantine", "/console/quarantine"),
]


async def take(out: Path) -> None:
    executable = shutil.which("chromium")
    if executable is None:
        raise SystemExit("needs chromium (apt-get install chromium)")
    with (
        tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile,
        chromium(executable, Path(profile)) as browser,
    ):
        async with console_rig() as console:
            for width, height in ((1280, 800), (390, 844)):
                page = await open_page(browser, width, height)
                await sign_in(page, console)
                for name, path in SHOTS:
                    await page.open(console.base + path)
                    target = out / f"console-{name}-{width}.png"
                    target.write_bytes(await page.screenshot())
                    print(target)


if __name__ == "__main__":
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/images")
    folder.mkdir(parents=True, exist_ok=True)
    asyncio.run(take(folder))

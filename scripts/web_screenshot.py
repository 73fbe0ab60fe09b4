"""A screenshot of `zoo serve`'s web page answering a real question: starts the server with the
given key=value arguments, opens / in Debian's headless Chromium (Playwright, never a
downloaded browser), sends the question and saves the page once the reply has streamed in.

    python scripts/web_screenshot.py                     # SmolLM2-135M (the wheel's Q4_1 GGUF, kept as int4)
    python scripts/web_screenshot.py --out scripts/results/web_chat_smollm2.png --question "Name three French cities."
    python scripts/web_screenshot.py --dark --out /tmp/dark.png           # the dark colour scheme
    python scripts/web_screenshot.py --serve conf=llama3_8b_tiny compile=false --question "Hi"

The server runs in its own process on a free port and is stopped at the end; its log goes to
stderr when it fails to start. tests/test_serve_web.py is the test; this is for pictures.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", nargs="*", default=["conf=smollm2_135m", "quant=int4", "compile=false", "max_seq=1024",
                                                    "max_batch=2"], help="zoo serve key=value arguments")
    ap.add_argument("--question", default="What is the capital of France? Answer in one sentence.")
    ap.add_argument("--system", default="You are a helpful assistant.")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "web_chat_smollm2.png"))
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--width", type=int, default=1440)
    ap.add_argument("--height", type=int, default=1280)
    ap.add_argument("--dark", action="store_true", help="the page in the OS's dark colour scheme")
    args = ap.parse_args()

    from playwright.sync_api import sync_playwright

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile("w+")  # the server's output, shown when it fails to start
    proc = subprocess.Popen([sys.executable, "-m", "zoo.cli", "serve", f"port={port}", "log_level=warning",
                             *args.serve], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    try:
        import httpx

        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                sys.stderr.write(log.read()[-4000:])
                print(f"zoo serve did not come up (exit {proc.poll()})", file=sys.stderr)
                return 1
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": args.width, "height": args.height},
                                    color_scheme="dark" if args.dark else "light")
            page.goto(base + "/")
            page.wait_for_selector("#card-body .legend", timeout=60_000)
            for field, value in (("system", args.system), ("temperature", "0"), ("max_tokens", str(args.max_tokens))):
                page.fill(f"#{field}", value)
                page.dispatch_event(f"#{field}", "change")
            page.fill("#input", args.question)
            page.click("#send")
            page.wait_for_selector('.msg.assistant:not([data-state="streaming"])', timeout=300_000)
            page.wait_for_timeout(1500)  # a metrics poll after the reply
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=args.out)
            print(page.locator(".msg.assistant .content").first.text_content())
            print(f"wrote {args.out}")
            browser.close()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Check the built documentation site in a real browser: Debian's headless Chromium, driven through chromedriver.

    mkdocs build --strict && python scripts/check_site.py site [--screenshots DIR] [--query KEY]

The site is served on 127.0.0.1 (a free port) from a thread of this process. Every page is loaded; the check fails
when a page logs a console error (a script exception, a failed resource), when an internal link points to a page or
file the server does not have or to an anchor its page does not hold, or when the search does not find ``--query``
(a configuration key) on the configuration reference. ``--screenshots DIR`` writes ``front_page.png`` and
``config_reference.png``. Exit status 0 when all is well, 1 otherwise, 2 when no browser is installed
(``apt-get install chromium chromium-driver``; ``scripts/run_tests.sh`` does it as root).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import shutil
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urldefrag, urljoin, urlparse

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# Without the networking flags Chromium keeps trying to reach Google's hosts, which a closed network refuses.
CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1280,900")


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # the check prints its own lines
        pass


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def browser(user_data: str):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={user_data}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def pages(site: Path) -> list[str]:
    """The site's pages as paths below its root: ``""`` for the front page, ``"reference/config/"``, ..."""
    found = sorted(str(p.parent.relative_to(site)) for p in site.rglob("index.html"))
    return ["" if p == "." else f"{p}/" for p in found]


def load(driver, url: str) -> None:
    driver.get(url)
    deadline = time.monotonic() + 30
    while driver.execute_script("return document.readyState") != "complete" and time.monotonic() < deadline:
        time.sleep(0.05)


def console_errors(driver) -> list[str]:
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def search(driver, base: str, query: str) -> list[str]:
    """The result links Material's search shows for ``query``, typed into its search box on the front page."""
    from selenium.webdriver.common.by import By

    load(driver, base)
    box = driver.find_element(By.CSS_SELECTOR, "input.md-search__input")
    if not box.is_displayed():  # a narrow window hides the box behind the header's search button
        driver.find_element(By.CSS_SELECTOR, "label.md-header__button[for='__search']").click()
    box.click()
    box.send_keys(query)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        links = [a.get_attribute("href") for a in driver.find_elements(By.CSS_SELECTOR, ".md-search-result__link")]
        if links:
            return links
        time.sleep(0.2)
    return []


def check(site: Path, query: str, screenshots: Path | None) -> list[str]:
    """Every problem found, one line each (empty: the site passed)."""
    server, base = serve(site)
    user_data = tempfile.mkdtemp(prefix="check_site_")
    driver = browser(user_data)
    problems: list[str] = []
    anchors: dict[str, set[str]] = {}
    links: dict[str, str] = {}  # link -> the first page that has it
    try:
        for page in pages(site):
            url = base + page
            load(driver, url)
            problems += [f"{page or '/'}: console error: {message}" for message in console_errors(driver)]
            anchors[urldefrag(url)[0]] = set(driver.execute_script(
                "return Array.from(document.querySelectorAll('[id]'), e => e.id)"))
            for href in driver.execute_script("return Array.from(document.querySelectorAll('a[href]'), a => a.href)"):
                if urlparse(href).netloc == urlparse(base).netloc:
                    links.setdefault(href, page or "/")
        targets = {urldefrag(link)[0] for link in links}
        missing = {target for target in targets if target not in anchors and status(target) != 200}
        for link, page in sorted(links.items()):
            target, fragment = urldefrag(link)
            if target in missing:
                problems.append(f"{page}: broken link {link[len(base) - 1:]}")
            elif fragment and target in anchors and fragment not in anchors[target]:
                problems.append(f"{page}: link {link[len(base) - 1:]}: no anchor #{fragment} there")
        results = search(driver, base, query)
        key = query.replace(".", "")  # a heading's anchor: the dotted key without its dots
        found = [r for r in results if "/reference/config/" in r and urldefrag(r)[1].endswith(key)]
        if not found:
            problems.append(f"search: {query!r} did not find the configuration reference (results: {results[:5]})")
        if screenshots is not None:
            screenshots.mkdir(parents=True, exist_ok=True)
            for name, page in (("front_page", ""), ("config_reference", "reference/config/")):
                load(driver, urljoin(base, page))
                driver.save_screenshot(str(screenshots / f"{name}.png"))
        print(f"check_site: {len(anchors)} pages loaded in Chromium, {len(links)} internal links checked "
              f"({len(targets)} targets), search {query!r} -> {found[0][len(base) - 1:] if found else 'nothing'}")
    finally:
        driver.quit()
        server.shutdown()
        shutil.rmtree(user_data, ignore_errors=True)
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("site", type=Path, help="the built site (mkdocs build writes site/)")
    parser.add_argument("--query", default="max_overflow_share", help="a configuration key the search must find")
    parser.add_argument("--screenshots", type=Path, help="write front_page.png and config_reference.png here")
    args = parser.parse_args(argv)
    if not (args.site / "index.html").is_file():
        print(f"check_site: site: no index.html in {args.site}; build it with mkdocs build --strict", file=sys.stderr)
        return 2
    absent = [path for path in (CHROMIUM, CHROMEDRIVER) if not Path(path).is_file()]
    if absent:
        print(f"check_site: {', '.join(absent)} not installed; apt-get install chromium chromium-driver",
              file=sys.stderr)
        return 2
    problems = check(args.site, args.query, args.screenshots)
    for problem in problems:
        print(f"check_site: {problem}", file=sys.stderr)
    print(f"check_site: {'FAILED, ' + str(len(problems)) + ' problems' if problems else 'ok'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

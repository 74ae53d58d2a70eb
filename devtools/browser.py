"""Headless Chromium (Debian's `chromium` and `chromium-driver`) driven by Selenium: what the
job page's browser test and its screenshot script run the page in."""

from __future__ import annotations

import shutil

MISSING = "Debian's chromium and chromium-driver are not installed (apt-get install chromium chromium-driver)"


def available() -> bool:
    return bool(shutil.which("chromium") and shutil.which("chromedriver"))


def chromium(width: int = 1400, height: int = 1800):
    """A headless Chromium session at `width` x `height`; RuntimeError(MISSING) without the
    packages."""
    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if browser is None or driver is None:
        raise RuntimeError(MISSING)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    options.add_argument(f"--window-size={width},{height}")
    return webdriver.Chrome(service=Service(driver), options=options)

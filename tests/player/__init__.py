"""The player page in a real browser (Debian's chromium through Playwright)."""

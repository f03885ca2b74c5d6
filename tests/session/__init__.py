"""One session and its units: calls, outcomes, sending, pacing, requests, scripts, timeouts."""

"""The one HTTP client of the engine senders: JSON requests to one server, an optional API key, a timeout, and every
failure (HTTP error status, refused / reset / timed-out connection) as an EngineError naming the URL and what the
server said. The engine modules (sglang.py, vllm.py) subclass it with their routes and how those routes answer."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from ..errors import EngineError, HTTPStatusError


class HTTPClient:
    """One engine server at `url` (a trailing slash is dropped)."""

    def __init__(self, url: str, timeout: float = 300.0, api_key: str | None = None):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.api_key = api_key

    def request(self, path: str, payload: dict | None = None, method: str = "POST", timeout: float | None = None,
                ok_codes: tuple[int, ...] = ()) -> tuple[int, str]:
        """(HTTP status, body text) of one request; `payload` goes as JSON on a POST (none: no body). An error
        status not in `ok_codes` raises HTTPStatusError (an EngineError) with the server's answer."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:  # servers started with --api-key: "Authorization: Bearer <key>" (sglang utils/auth.py, vllm)
            headers["Authorization"] = f"Bearer {self.api_key}"
        body = json.dumps(payload).encode() if payload is not None and method == "POST" else None
        req = urllib.request.Request(self.url + path, data=body, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as resp:
                return resp.status, resp.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            if e.code in ok_codes:
                return e.code, text
            raise HTTPStatusError(f"{self.url}{path}: HTTP {e.code}: {text[:500]}", e.code) from None
        except OSError as e:  # refused, reset, timed out
            raise EngineError(f"{self.url}{path}: {type(e).__name__}: {e}") from None

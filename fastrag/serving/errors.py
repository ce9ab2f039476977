"""Errors of `fastrag serve` in OpenAI's `{"error": {...}}` shape: the framework's own (bad JSON, a body that is not
read as JSON, a path not served) and the engine's, with the status a request's own settings earn (422) apart from
the server's faults (500)."""

# engine errors a request's own settings cause (422, not 500): its prompt or budget past the context, the method's
# demos (its dataset, fewshot) leaving no room in the context, a sequence larger than the KV pool
REQUEST_ERRORS = ("exceeds the model context", "leaves no room in the model context",
                  "the pool can ever give one sequence")


def error_status(message: str) -> int:
    return 422 if any(k in message for k in REQUEST_ERRORS) else 500


def error_response(status: int, message: str, headers: dict | None = None, kind: str | None = None):
    from fastapi.responses import JSONResponse

    err = {"type": "invalid_request_error" if status < 500 else "server_error", "message": message}
    if kind:
        err["code"] = kind
    return JSONResponse(status_code=status, headers=headers, content={"error": err})


def json_media_type(content_type: str) -> bool:
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def install_error_handlers(app) -> None:
    """The app's handlers of request validation errors and of the framework's HTTP errors."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    _error = error_response
    _json_media_type = json_media_type

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errs = []
        for e in exc.errors():
            if e.get("type") == "json_invalid":  # loc ("body", character offset)
                at = e.get("loc", ())[-1]
                why = (e.get("ctx") or {}).get("error", "")
                errs.append(f"body: not valid JSON at character {at}" + (f" ({why})" if why else ""))
                continue
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
            kind = request.headers.get("content-type")
            if loc == "body" and not _json_media_type(kind or ""):
                # the framework reads a body as JSON only under a JSON media type: curl -d sends
                # application/x-www-form-urlencoded, and the framework's own message blames the body's shape
                had = f"its Content-Type is {kind!r}" if kind else "it has no Content-Type"
                errs.append(f"body: not read as JSON, {had}: send Content-Type: application/json")
                continue
            errs.append(f"{loc}: {e.get('msg')}")
        return JSONResponse(status_code=422, content={"error": {"type": "invalid_request_error",
                                                                "message": "; ".join(errs), "fields": errs}})

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        """Starlette's and FastAPI's own errors (a path not served, a method the path does not take, a body that
        cannot be parsed) in the `{"error": ...}` shape of every other error here (they answered `{"detail": ...}`);
        a body that is not UTF-8 says so."""
        message = str(exc.detail)
        if exc.status_code == 400:
            try:
                (await request.body()).decode("utf-8")
            except UnicodeDecodeError as e:
                message = f"body: not UTF-8 text (byte {e.start} is {e.object[e.start]:#04x})"
        return _error(exc.status_code, message, headers=getattr(exc, "headers", None))

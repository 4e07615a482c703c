"""The OpenAI-compatible HTTP server: request bodies and answers (`protocol`), text as tokens arrive
(`text`), chat templates (`chat`), the thread that steps the engine (`loop`), the ASGI app (`app`) and
running it (`serve`). FastAPI and uvicorn come with the `[serve]` extra."""

"""jitllmd's server: OpenAI's HTTP API over one engine thread (llama.cpp's server design).

app (routes and the guard in front of them), schemas (requests checked field by field), errors (OpenAI's
error object), engine (the engine thread, its queue and slots), prefix_cache (sessions kept and matched by
token ids), choices and responses (a choice's text, stop strings, OpenAI's response objects), placement
(the live placement endpoint), metrics (Prometheus), serve (socket, engine and uvicorn together), client
(the verbs that talk to a running server).
"""

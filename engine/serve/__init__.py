"""`expertstream serve`: the HTTP server (engine.serve.server) and its protocols, one module
each (openai, responses, anthropic, ollama), over the request checks they share
(engine.serve.bodies, engine.serve.messages) and the tool calls of a reply
(engine.serve.tool_calls); `serve --pipeline`'s generation thread (engine.serve.pipeline).
A front end: no core module of the engine imports this package.
"""

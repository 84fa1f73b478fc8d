"""ExpertStream's desktop app: chat with a streamed MoE model and watch its expert cache.

`app.main:main` is the `expertstream-gui` console script. The engine knows nothing of Qt:
`app.worker` runs it on a thread of its own, `app.monitor` and `app.conversation` turn its
plain data into what the views draw, and the widgets (`chat`, `inspector`, `controls`,
`window`) only render and send commands.
"""

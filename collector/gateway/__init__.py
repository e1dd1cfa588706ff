"""An OpenAI-compatible gateway that lets an unmodified agent produce trainable episodes.

:mod:`.server` serves per-episode base URLs, :mod:`.session` builds token-exact prompts,
:mod:`.assembly` turns an episode's calls into stored turns, :mod:`.external` runs an agent
command per episode, :mod:`.standalone` is the ``sandpiper gateway`` process, and the
``*_api`` modules speak the chat, responses and messages APIs. docs/gateway.md has the design.
"""

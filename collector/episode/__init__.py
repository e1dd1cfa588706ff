"""One episode, from the prompt to the scored record.

- :mod:`.loop` — the episode loop: prepare the sandbox, ask the policy, run the tool calls,
  read the answer, score it (``run_episode``, ``run_pooled_episode``, ``finish_episode``).
- :mod:`.policy` — the token-in/token-out policy session (training); :mod:`.chat_policy` —
  the same over any OpenAI-compatible chat endpoint (evaluation, no token ids).
- :mod:`.render` — the chat template as token ids, rendered once and extended turn by turn.
- :mod:`.parsers` — the model's text to tool calls (one size check for a call's arguments);
  :mod:`.client_tools` — tools a client declares, in the plain-text formats.
- :mod:`.tools` — the agent's tools in the sandbox: ``execute_bash``, ``str_replace_editor``,
  ``submit``.
"""

"""A checkpoint's chat template: messages in, the prompt text the model was trained on out.

Templates are Jinja, as transformers keeps them: `chat_template` in tokenizer_config.json (a string, or a
list of named templates, "default" first) or a `chat_template.jinja` file beside it. They render in
Jinja's sandbox with `messages`, `add_generation_prompt=True` and the tokenizer's special-token strings.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import CheckpointError, RequestError
from .protocol import checked_text

ROLES = ("system", "user", "assistant", "tool", "developer")


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message):
            raise TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        try:
            self.template = env.from_string(source)
        except TemplateError as e:
            raise CheckpointError(f"the checkpoint's chat template does not parse: {e}") from None
        self.special_tokens = special_tokens

    @classmethod
    def from_checkpoint(cls, folder: str | Path) -> "ChatTemplate | None":
        folder = Path(folder)
        config, source = {}, None
        config_file = folder / "tokenizer_config.json"
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text())
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{config_file} is not valid JSON: {e}") from None
            source = config.get("chat_template")
            if isinstance(source, list):  # named templates
                named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
                source = named.get("default") or next(iter(named.values()), None)
        if source is None and (folder / "chat_template.jinja").is_file():
            source = (folder / "chat_template.jinja").read_text()
        if not isinstance(source, str) or not source:
            return None
        special = {k: v for k in ("bos_token", "eos_token", "pad_token", "unk_token")
                   if isinstance(v := config.get(k), str)}
        return cls(source, special)

    def render(self, messages: list[dict]) -> str:
        from jinja2 import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=True, **self.special_tokens)
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise RequestError(f"the chat template cannot render these messages: {type(e).__name__}: {e}") from None


def checked_messages(messages) -> list[dict]:
    """`messages` as the template expects them ({"role", "content": str}); text parts of a content list are
    joined. Anything else is a RequestError naming the message."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"messages[{i}] needs a role, one of {', '.join(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise RequestError(f"messages[{i}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string or a list of text parts")
        checked_text(content, f"messages[{i}].content")
        out.append({**{k: v for k, v in m.items() if k != "content"}, "content": content})
    return out

"""The routing key of a prompt: chained hashes of its leading blocks, the way the KV pool keys its pages
(each block's key holds its parent's hash, so equal hashes mean equal prefixes up to that block). The
ingress hashes text blocks of the request body (no tokenizer, chat template or torch in the ingress); a
prompt given as token ids is blocked exactly as the pool blocks it.
"""

from __future__ import annotations

import hashlib
from typing import Any

BLOCK_CHARS = 64  # about one 16-token KV block of English text with the tiny models' tokenizer
TOKEN_BLOCK = 16  # the pool's default block_size, for prompts sent as token ids
MAX_BLOCKS = 256  # a routing key needs the leading blocks only


def _chain(blocks: list[bytes], route: str) -> list[int]:
    """One stable 64-bit hash per block, each over (route, parent hash, block): equal across processes."""
    out: list[int] = []
    parent = hashlib.blake2b(route.encode(), digest_size=8).digest()
    for block in blocks:
        parent = hashlib.blake2b(parent + block, digest_size=8).digest()
        out.append(int.from_bytes(parent, "big"))
    return out


def _message_text(message: Any) -> str:
    """A chat message as the text its rendering starts with: role, then content (parts' text joined)."""
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    if not isinstance(content, str):
        content = ""
    return f"<{message.get('role', '')}>{content}\n"


def prompt_text(body: dict[str, Any]) -> str | list[int] | None:
    """The prompt of a chat or completion body as routing text (or token ids); None when it has none."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(_message_text(m) for m in messages)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    return None


def block_hashes(route: str, prompt: str | list[int] | None, *, block_chars: int = BLOCK_CHARS,
                 token_block: int = TOKEN_BLOCK, max_blocks: int = MAX_BLOCKS) -> list[int]:
    """Chained hashes of the prompt's full leading blocks on `route` (a partial last block has none, as in
    the pool)."""
    if not prompt:
        return []
    if isinstance(prompt, str):
        data = prompt.encode()
        n = min(len(data) // block_chars, max_blocks)
        blocks = [data[i * block_chars:(i + 1) * block_chars] for i in range(n)]
    else:
        n = min(len(prompt) // token_block, max_blocks)
        blocks = [b"".join(t.to_bytes(4, "big", signed=True) for t in prompt[i * token_block:(i + 1) * token_block])
                  for i in range(n)]
    return _chain(blocks, route)

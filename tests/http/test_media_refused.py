"""A request that carries an image (or audio, a video, a file) is refused with one clear line: the
text model of a multimodal checkpoint (Qwen3.5) runs, its vision tower does not. The error names the
part's type, never echoes its (possibly megabytes of base64) data."""

from __future__ import annotations

import pytest

from tessera.peer.http.anthropic import parse_messages
from tessera.peer.http.requests import ApiError, parse_chat

IMAGE_DATA = "data:image/png;base64," + "A" * 10_000


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": IMAGE_DATA}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "file", "file": {"file_data": IMAGE_DATA}},
])
def test_an_openai_request_with_media_is_refused_by_kind(part):
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]}
    with pytest.raises(ApiError) as refused:
        parse_chat(body)
    message = str(refused.value)
    assert refused.value.status == 400 and f"type {part['type']!r} is not supported" in message
    assert "vision" in message and "AAAA" not in message and "\n" not in message


def test_an_anthropic_request_with_an_image_is_refused_by_kind():
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "A" * 10_000}}
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [image]}]}
    with pytest.raises(ApiError) as refused:
        parse_messages(body)
    assert "type 'image' is not supported" in str(refused.value) and "AAAA" not in str(refused.value)


def test_text_parts_still_pass():
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert parse_chat(body).messages[0]["content"] == "hi"

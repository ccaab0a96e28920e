"""The official `openai` Python client against a running `turbokv serve`.

Usage: python openai_client.py BASE_URL MODEL. Exits non-zero (with the failing check) on
any failure: chat streamed and not, completions, logprobs, and an error case.
"""

import sys

import openai
from openai import OpenAI


def main(base_url: str, model: str) -> None:
    client = OpenAI(base_url=base_url, api_key="test-key", max_retries=0, timeout=120)

    models = [m.id for m in client.models.list().data]
    assert models == [model], models

    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16,
        temperature=0,
    )
    text = chat.choices[0].message.content
    assert chat.choices[0].message.role == "assistant"
    assert text, chat
    assert chat.usage.completion_tokens >= 1, chat.usage
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens

    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                pieces.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    assert "".join(pieces) == text, ("".join(pieces), text)
    assert finish == chat.choices[0].finish_reason, finish
    assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens, usage

    comp = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=2
    )
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == 4, lp
    assert "".join(lp.tokens) == comp.choices[0].text, (lp.tokens, comp.choices[0].text)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and abs(max(top.values()) - chosen) < 1e-5, (chosen, top)

    chat_lp = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat_lp.choices[0].logprobs.content
    assert len(content) == chat_lp.usage.completion_tokens, content
    assert all(len(t.top_logprobs) == 2 for t in content), content

    try:
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        raise AssertionError("an unknown model must be refused")
    except openai.NotFoundError as e:
        assert e.status_code == 404 and e.body["code"] == "model_not_found", e.body
    try:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], temperature=7
        )
        raise AssertionError("temperature 7 must be refused")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and e.body["param"] == "temperature", e.body
    print(f"openai client {openai.__version__}: all checks passed")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

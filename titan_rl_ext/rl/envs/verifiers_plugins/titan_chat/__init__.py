"""``titan_chat``: a verifiers harness whose chat loop runs in-process (see ../README.md)."""

from __future__ import annotations

import json
from contextlib import AsyncExitStack
from typing import Any

from openai import APIStatusError, AsyncOpenAI
from verifiers.v1.clients import ModelContext
from verifiers.v1.configs.harness import HarnessConfig
from verifiers.v1.harness import Harness
from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp
from verifiers.v1.runtimes import ProgramResult, Runtime
from verifiers.v1.task import TaskData
from verifiers.v1.trace import Trace


class TitanChatConfig(HarnessConfig):
    max_turns: int = 8
    """Model calls per episode at most."""


class TitanChat(Harness[TitanChatConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: ModelContext, trace: Trace, runtime: Runtime, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: TaskData) -> ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [m.model_dump(exclude_none=True) for m in prompt or []]
        followups = list(getattr(data, "followups", None) or [])
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            async with AsyncExitStack() as stack:
                servers_cfg = {"mcpServers": {name: {"url": url} for name, url in mcp_urls.items()}}
                tools, dispatch, servers = await connect_mcp(servers_cfg, stack) if mcp_urls else ([], {}, {})
                for _ in range(self.config.max_turns):
                    resp = await client.chat.completions.create(model=ctx.model, messages=messages,
                                                                **({"tools": tools} if tools else {}))
                    msg = resp.choices[0].message
                    messages.append(msg.model_dump(exclude_none=True))
                    if msg.tool_calls:
                        for call in msg.tool_calls:
                            try:
                                args = json.loads(call.function.arguments or "{}")
                            except json.JSONDecodeError as e:
                                out = f"error: the arguments are not JSON ({e})"
                            else:
                                out = (await call_mcp(servers, dispatch, call.function.name, args)
                                       if call.function.name in dispatch else f"error: no tool named {call.function.name!r}")
                            messages.append({"role": "tool", "tool_call_id": call.id, "content": out})
                    elif followups:
                        messages.append({"role": "user", "content": followups.pop(0)})
                    else:
                        break
        except APIStatusError as e:  # a stop rule refused the next turn
            return ProgramResult(exit_code=1, stdout="", stderr=str(e))
        finally:
            await client.close()
        return ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["TitanChat"]

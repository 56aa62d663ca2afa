"""The reference evaluation of an OpenEnv environment for the reward-equality test: OpenEnv's own client
(GenericEnvClient, synchronous) and the official openai SDK, in the OpenEnv virtualenv, the loop written out here
as a user would write it (nothing of rollq's driver), one episode per run:

    stdin: {"server": URL, "reset": {...}, "system_prompt": "...", "sampling": {...}, "max_turns": N}
    stdout: the summed step rewards, last

Run as a command agent (`exec:PYTHON openenv_reference.py`), so its model calls go through rollq's recording proxy
(OPENAI_BASE_URL / OPENAI_API_KEY) to the same engine the driver's do.
"""

from __future__ import annotations

import json
import sys
import urllib.request

from openai import OpenAI
from openenv import GenericEnvClient


def main() -> None:
    job = json.loads(sys.stdin.read())
    with urllib.request.urlopen(f"{job['server']}/schema", timeout=10) as response:
        schema = json.loads(response.read())["action"]
    [field] = schema["required"]  # the length task's action: one text field
    model = OpenAI()
    served = model.models.list().data[0].id
    messages = [{"role": "system", "content": job["system_prompt"]}]
    total = 0.0
    with GenericEnvClient(base_url=job["server"]).sync() as env:
        result = env.reset(**job["reset"])
        for _ in range(job["max_turns"]):
            if result.done:
                break
            user = {"observation": result.observation, "action_schema": schema}
            messages.append({"role": "user", "content": json.dumps(user, ensure_ascii=False)})
            completion = model.chat.completions.create(model=served, messages=messages, extra_body=job["sampling"])
            reply = completion.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": reply})
            if not reply.strip():  # no action: the episode ends (the documented turn protocol)
                break
            result = env.step({field: reply.strip()})
            total += result.reward or 0.0
    print(json.dumps(total))


if __name__ == "__main__":
    main()

#!/bin/sh
# A trivial command agent (bench/agents.py part 2, workflow `exec:bench/command_agent.sh`): the worker runs it once
# per episode with OPENAI_BASE_URL / OPENAI_API_KEY set to a fresh recording-proxy session and the job's data as
# JSON on stdin. One chat completion through curl, then the reward as the last line of stdout.
set -eu
cat >/dev/null # the job's data (unused)
curl -sS --fail -o /dev/null "$OPENAI_BASE_URL/chat/completions" \
  -H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" \
  -d '{"model": "policy", "messages": [{"role": "user", "content": "Run the environment step."}], "max_tokens": 64}'
echo 1.0

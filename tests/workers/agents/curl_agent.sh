#!/bin/sh
# A command agent in shell: the job's data (a chat completions request body) arrives on stdin and goes to the proxy
# as it is; the last line printed is the reward.
set -eu
curl -sS --fail-with-body --max-time 60 \
  -H "Authorization: Bearer $OPENAI_API_KEY" -H "Content-Type: application/json" \
  --data-binary @- "$OPENAI_BASE_URL/chat/completions"
echo  # the response has no newline of its own: end its line, which is logged and ignored
echo 1.0

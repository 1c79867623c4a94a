"""Chat templates as real model folders ship them, tokenizers of their kinds, and the same templates marked for
transformers' ``return_assistant_tokens_mask``.

``SHIPPED`` holds each template as it appears in the named model's ``tokenizer_config.json`` (or its
``chat_template.jinja``): the test data a user brings. ``MARKED`` is the same template with ``{% generation %}``
around what the model writes in an assistant turn (the markers render nothing, and the tests check that the
two render the same text), so that transformers computes the reference supervision mask.

The tokenizers are trained in the test, each of the kind its family ships: SentencePiece-style BPE with byte
fallback and a prepended ``▁`` (Llama 2, Mistral, OpenChat and Phi-3), the same without the prepended ``▁``
(Gemma), byte-level BPE with Llama 3's split pattern (also Phi-4's, OLMo 2's and Mistral Nemo's kind: tiktoken-style
pre-tokenization), and byte-level BPE as GPT-2, Qwen and Granite have it.

Where each template comes from: the model's own ``tokenizer_config.json`` (named beside it), as copied in public
repositories: llama.cpp's ``models/templates`` (Gemma 2, Phi-3.5, Granite 3.3, Mistral Nemo), unsloth's
``chat_templates.py`` (Gemma 3, printed from the tokenizer; Phi-4), and training scripts that set OLMo 2's
(``allenai/OLMo-2-1124-7B-SFT``'s, Tülu 3's shape).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

LLAMA2_CHAT = (  # meta-llama/Llama-2-7b-chat-hf
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
LLAMA3_INSTRUCT = (  # meta-llama/Meta-Llama-3-8B-Instruct
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
OPENCHAT = (  # openchat/openchat-3.5-0106
    "{{ bos_token }}{% for message in messages %}{{ 'GPT4 Correct ' + message['role'].title() + ': ' + "
    "message['content'] + '<|end_of_turn|>'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ 'GPT4 Correct Assistant:' }}{% endif %}"
)
CHATML = (  # teknium/OpenHermes-2.5-Mistral-7B
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DEEPSEEK_R1 = (  # deepseek-ai/DeepSeek-R1-Distill-Qwen-32B (its tool branches left in, unused here)
    "{% if not add_generation_prompt is defined -%}\n  {%- set add_generation_prompt = false -%}\n{%- endif -%}\n"
    "{%- set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='') -%}\n"
    "{%- for message in messages -%}\n  {%- if message['role'] == 'system' -%}\n"
    "    {%- set ns.system_prompt = message['content'] -%}\n  {%- endif -%}\n{%- endfor -%}"
    "{{bos_token}}{{ns.system_prompt}}\n{%- for message in messages -%}\n  {%- if message['role'] == 'user' -%}\n"
    "    {%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}\n  {%- endif -%}\n"
    "  {%- if message['role'] == 'assistant' and message['content'] is not none -%}\n"
    "    {%- if ns.is_tool -%}{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}\n"
    "      {%- set ns.is_tool = false -%}\n    {%- else -%}\n      {%- set content = message['content'] -%}\n"
    "      {%- if '</think>' in content -%}\n        {%- set content = content.split('</think>')[-1] -%}\n"
    "      {%- endif -%}{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}\n    {%- endif -%}\n  {%- endif -%}\n"
    "{%- endfor -%}\n{%- if add_generation_prompt and not ns.is_tool -%}{{'<｜Assistant｜><think>\\n'}}\n{%- endif %}"
)
PHI3 = (  # microsoft/Phi-3-mini-4k-instruct: closes a conversation without a generation prompt with eos_token
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
    "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
# Written for these tests, in the shape of OLMo 3's template: a turn followed by more ends with <|im_end|>, the
# conversation's last one with eos_token instead.
LAST_TURN_EOS = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] }}"
    "{% if loop.last and message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

GEMMA2 = (  # google/gemma-2-2b-it: no system role; "model" is the assistant's
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
GEMMA3 = (  # google/gemma-3-1b-it: a system message joins the first user turn
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    '        {{ raise_exception("Invalid content type") }}\n'
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{ '<start_of_turn>model\\n' }}\n"
    "{%- endif -%}\n"
)
PHI4 = (  # microsoft/phi-4: ChatML turns whose header ends with <|im_sep|>
    "{% for message in messages %}{% if (message['role'] == 'system') %}"
    "{{'<|im_start|>system<|im_sep|>' + message['content'] + '<|im_end|>'}}{% elif (message['role'] == 'user') %}"
    "{{'<|im_start|>user<|im_sep|>' + message['content'] + '<|im_end|>'}}{% elif (message['role'] == 'assistant') %}"
    "{{'<|im_start|>assistant<|im_sep|>' + message['content'] + '<|im_end|>'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant<|im_sep|>' }}{% endif %}"
)
OLMO2 = (  # allenai/OLMo-2-1124-7B-SFT (Tülu 3's): a turn followed by more ends with eos_token and a newline
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ '<|system|>\n' + message['content'] + '\n' }}{% elif message['role'] == 'user' %}"
    "{{ '<|user|>\n' + message['content'] + '\n' }}{% elif message['role'] == 'assistant' %}"
    "{% if not loop.last %}{{ '<|assistant|>\n'  + message['content'] + eos_token + '\n' }}"
    "{% else %}{{ '<|assistant|>\n'  + message['content'] + eos_token }}{% endif %}{% endif %}"
    "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}{% endfor %}"
)
_GRANITE_TURN = (
    "     {{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + '<|end_of_text|>\n' }}\n"
)
GRANITE3 = (  # ibm-granite/granite-3.3-2b-instruct: a dated default system message, role tags as special tokens
    "{# Alias tools -> available_tools #}\n{%- if tools and not available_tools -%}\n"
    "    {%- set available_tools = tools -%}\n{%- endif -%}\n{%- if messages[0]['role'] == 'system' %}\n"
    "     {%- set system_message = messages[0]['content'] %}\n     {%- set loop_messages = messages[1:] %}\n"
    " {%- else %}\n"
    "     {%- set system_message = \"Knowledge Cutoff Date: April 2024. Today's Date: \" + strftime_now('%B %d, %Y')"
    ' + ". You are Granite, developed by IBM." %}\n'
    "     {%- if available_tools and documents %}\n"
    '         {%- set system_message = system_message + " You are a helpful assistant with access to the following '
    "tools. When a tool is required to answer the user's query, respond only with <|tool_call|> followed by a JSON "
    "list of tools used. If a tool does not exist in the provided list of tools, notify the user that you do not have "
    "the ability to fulfill the request. Write the response to the user's input by strictly aligning with the facts "
    "in the provided documents. If the information needed to answer the question is not available in the documents, "
    'inform the user that the question cannot be answered based on the available data." %}\n'
    "     {%- elif available_tools %}\n"
    '         {%- set system_message = system_message + " You are a helpful assistant with access to the following '
    "tools. When a tool is required to answer the user's query, respond only with <|tool_call|> followed by a JSON "
    "list of tools used. If a tool does not exist in the provided list of tools, notify the user that you do not have "
    'the ability to fulfill the request." %}\n'
    "     {%- elif documents %}\n"
    "         {%- set system_message = system_message + \" Write the response to the user's input by strictly "
    "aligning with the facts in the provided documents. If the information needed to answer the question is not "
    "available in the documents, inform the user that the question cannot be answered based on the available "
    'data." %}\n'
    "    {%- elif thinking %}\n"
    '    {%- set system_message = system_message + " You are a helpful AI assistant.\nRespond to every user query '
    "in a comprehensive and detailed way. You can write down your thoughts and reasoning process before responding. "
    "In the thought process, engage in a comprehensive cycle of analysis, summarization, exploration, reassessment, "
    "reflection, backtracing, and iteration to develop well-considered thinking process. In the response section, "
    "based on various attempts, explorations, and reflections from the thoughts section, systematically present the "
    "final solution that you deem correct. The response should summarize the thought process. Write your thoughts "
    'between <think></think> and write your response between <response></response> for each user query." %}\n'
    "     {%- else %}\n"
    '         {%- set system_message = system_message + " You are a helpful AI assistant." %}\n'
    "     {%- endif %}\n"
    "     {%- if 'citations' in controls and documents %}\n"
    "         {%- set system_message = system_message + '\nUse the symbols <|start_of_cite|> and <|end_of_cite|> to "
    "indicate when a fact comes from a document in the search result, e.g <|start_of_cite|> {document_id: 1}my fact "
    "<|end_of_cite|> for a fact from document 1. Afterwards, list all the citations with their corresponding "
    "documents in an ordered list.' %}\n"
    "     {%- endif %}\n"
    "     {%- if 'hallucinations' in controls and documents %}\n"
    "         {%- set system_message = system_message + '\nFinally, after the response is written, include a numbered "
    "list of sentences from the response with a corresponding risk value that are hallucinated and not based in the "
    "documents.' %}\n"
    "     {%- endif %}\n"
    "     {%- set loop_messages = messages %}\n"
    " {%- endif %}\n"
    " {{- '<|start_of_role|>system<|end_of_role|>' + system_message + '<|end_of_text|>\n' }}\n"
    " {%- if available_tools %}\n"
    "     {{- '<|start_of_role|>available_tools<|end_of_role|>' }}\n"
    "     {{- available_tools | tojson(indent=4) }}\n"
    "     {{- '<|end_of_text|>\n' }}\n"
    " {%- endif %}\n"
    " {%- if documents %}\n"
    "     {%- for document in documents %}\n"
    "         {{- '<|start_of_role|>document {\"document_id\": \"' + document['doc_id'] | string + '\"}"
    "<|end_of_role|>\n' }}\n"
    "         {{- document['text'] }}\n"
    "         {{- '<|end_of_text|>\n' }}\n"
    "              {%- endfor %}\n"
    " {%- endif %}\n"
    " {%- for message in loop_messages %}\n" + _GRANITE_TURN + "     {%- if loop.last and add_generation_prompt %}\n"
    "         {{- '<|start_of_role|>assistant' }}\n"
    "             {%- if controls %}\n"
    "                 {{- ' ' + controls | tojson()}}\n"
    "             {%- endif %}\n"
    "         {{- '<|end_of_role|>' }}\n"
    "     {%- endif %}\n"
    " {%- endfor %}\n"
)

MISTRAL_NEMO = (  # mistralai/Mistral-Nemo-Instruct-2407: the system message goes into the LAST user turn
    '{%- if messages[0]["role"] == "system" %}\n    {%- set system_message = messages[0]["content"] %}\n'
    "    {%- set loop_messages = messages[1:] %}\n{%- else %}\n    {%- set loop_messages = messages %}\n"
    "{%- endif %}\n{%- if not tools is defined %}\n    {%- set tools = none %}\n{%- endif %}\n"
    '{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}\n\n'
    "{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}\n"
    "{%- set ns = namespace() %}\n{%- set ns.index = 0 %}\n{%- for message in loop_messages %}\n"
    '    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and '
    "message.tool_calls is not none)) %}\n"
    '        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}\n'
    '            {{- raise_exception("After the optional system message, conversation roles must alternate '
    'user/assistant/user/assistant/...") }}\n'
    "        {%- endif %}\n        {%- set ns.index = ns.index + 1 %}\n    {%- endif %}\n{%- endfor %}\n\n"
    "{{- bos_token }}\n{%- for message in loop_messages %}\n"
    '    {%- if message["role"] == "user" %}\n'
    "        {%- if tools is not none and (message == user_messages[-1]) %}\n"
    '            {{- "[AVAILABLE_TOOLS][" }}\n            {%- for tool in tools %}\n'
    "                {%- set tool = tool.function %}\n"
    '                {{- \'{"type": "function", "function": {\' }}\n'
    '                {%- for key, val in tool.items() if key != "return" %}\n'
    "                    {%- if val is string %}\n"
    "                        {{- '\"' + key + '\": \"' + val + '\"' }}\n"
    "                    {%- else %}\n"
    "                        {{- '\"' + key + '\": ' + val|tojson }}\n"
    "                    {%- endif %}\n"
    "                    {%- if not loop.last %}\n"
    '                        {{- ", " }}\n'
    "                    {%- endif %}\n"
    "                {%- endfor %}\n"
    '                {{- "}}" }}\n'
    "                {%- if not loop.last %}\n"
    '                    {{- ", " }}\n'
    "                {%- else %}\n"
    '                    {{- "]" }}\n'
    "                {%- endif %}\n"
    "            {%- endfor %}\n"
    '            {{- "[/AVAILABLE_TOOLS]" }}\n'
    "            {%- endif %}\n"
    "        {%- if loop.last and system_message is defined %}\n"
    '            {{- "[INST]" + system_message + "\\n\\n" + message["content"] + "[/INST]" }}\n'
    "        {%- else %}\n"
    '            {{- "[INST]" + message["content"] + "[/INST]" }}\n'
    "        {%- endif %}\n"
    "    {%- elif (message.tool_calls is defined and message.tool_calls is not none) %}\n"
    '        {{- "[TOOL_CALLS][" }}\n'
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- set out = tool_call.function|tojson %}\n"
    "            {{- out[:-1] }}\n"
    "            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}\n"
    '                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}\n'
    "            {%- endif %}\n"
    "            {{- ', \"id\": \"' + tool_call.id + '\"}' }}\n"
    "            {%- if not loop.last %}\n"
    '                {{- ", " }}\n'
    "            {%- else %}\n"
    '                {{- "]" + eos_token }}\n'
    "            {%- endif %}\n"
    "        {%- endfor %}\n"
    '    {%- elif message["role"] == "assistant" %}\n'
    '        {{- message["content"] + eos_token}}\n'
    '    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}\n'
    "        {%- if message.content is defined and message.content.content is defined %}\n"
    "            {%- set content = message.content.content %}\n"
    "        {%- else %}\n"
    "            {%- set content = message.content %}\n"
    "        {%- endif %}\n"
    '        {{- \'[TOOL_RESULTS]{"content": \' + content|string + ", " }}\n'
    "        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}\n"
    '            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}\n'
    "        {%- endif %}\n"
    "        {{- '\"call_id\": \"' + message.tool_call_id + '\"}[/TOOL_RESULTS]' }}\n"
    "    {%- else %}\n"
    '        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial '
    'optional system message!") }}\n'
    "    {%- endif %}\n"
    "{%- endfor %}\n"
)
MISTRAL_NEMO_MARKED = MISTRAL_NEMO.replace(
    '        {{- message["content"] + eos_token}}\n',
    '        {% generation %}{{- message["content"] + eos_token}}{% endgeneration %}\n',
)
"""Mistral Nemo's template cannot be told apart by the token-position rule (what precedes a reply depends on the
turns after it); marked, it can (``prepare --chat_template``)."""

SHIPPED = {
    "llama2": LLAMA2_CHAT,
    "llama3": LLAMA3_INSTRUCT,
    "openchat": OPENCHAT,
    "chatml": CHATML,
    "deepseek_r1": DEEPSEEK_R1,
    "phi3": PHI3,
    "last_turn_eos": LAST_TURN_EOS,
    "gemma2": GEMMA2,
    "gemma3": GEMMA3,
    "phi4": PHI4,
    "olmo2": OLMO2,
    "granite3": GRANITE3,
}
MARKED = {
    "llama2": LLAMA2_CHAT.replace(
        "{{ ' '  + content.strip() + ' ' + eos_token }}",
        "{% generation %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endgeneration %}",
    ),
    "llama3": (
        "{% for message in messages %}{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
        "{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    "openchat": (
        "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}"
        "{{ 'GPT4 Correct Assistant:' }}{% generation %}{{ ' ' + message['content'] + '<|end_of_turn|>' }}"
        "{% endgeneration %}{% else %}{{ 'GPT4 Correct ' + message['role'].title() + ': ' + message['content'] + "
        "'<|end_of_turn|>'}}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'GPT4 Correct Assistant:' }}"
        "{% endif %}"
    ),
    "chatml": (
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
        "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "phi3": PHI3.replace(
        "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}",
        "{{'<|assistant|>\n'}}{% generation %}{{ message['content'] + '<|end|>' }}{% endgeneration %}{{ '\n' }}",
    ),
    "last_turn_eos": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}"
        "{% if loop.last %}{{ eos_token }}{% else %}{{ '<|im_end|>' }}{% endif %}{% endgeneration %}"
        "{% if not loop.last %}{{ '\n' }}{% endif %}"
        "{% else %}{{ message['content'] }}{% if loop.last and message['role'] == 'assistant' %}{{ eos_token }}"
        "{% else %}{{ '<|im_end|>\n' }}{% endif %}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "deepseek_r1": DEEPSEEK_R1.replace(
        "{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}",
        "{{'<｜Assistant｜>'}}{% generation %}{{ content + '<｜end▁of▁sentence｜>' }}{% endgeneration %}",
    ),
    "gemma2": GEMMA2.replace(
        "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}",
        "{% if role == 'model' %}{{ '<start_of_turn>model\n' }}{% generation %}"
        "{{ message['content'] | trim + '<end_of_turn>' }}{% endgeneration %}{{ '\n' }}"
        "{% else %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endif %}",
    ),
    "gemma3": GEMMA3.replace(
        "    {%- if message['content'] is string -%}\n",
        "    {%- if role == 'model' -%}\n"
        "        {% generation %}{{ message['content'] | trim + '<end_of_turn>' }}{% endgeneration %}\n"
        "    {%- elif message['content'] is string -%}\n",
    ).replace(
        "    {{ '<end_of_turn>\\n' }}\n",
        "    {{ '\\n' if role == 'model' else '<end_of_turn>\\n' }}\n",
    ),
    "phi4": PHI4.replace(
        "{{'<|im_start|>assistant<|im_sep|>' + message['content'] + '<|im_end|>'}}",
        "{{'<|im_start|>assistant<|im_sep|>'}}{% generation %}{{ message['content'] + '<|im_end|>' }}"
        "{% endgeneration %}",
    ),
    "olmo2": OLMO2.replace(
        "{% if not loop.last %}{{ '<|assistant|>\n'  + message['content'] + eos_token + '\n' }}"
        "{% else %}{{ '<|assistant|>\n'  + message['content'] + eos_token }}{% endif %}",
        "{{ '<|assistant|>\n' }}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
        "{% if not loop.last %}{{ '\n' }}{% endif %}",
    ),
    "granite3": GRANITE3.replace(
        _GRANITE_TURN,
        "     {%- if message['role'] == 'assistant' %}\n"
        "     {{- '<|start_of_role|>assistant<|end_of_role|>' }}{% generation %}"
        "{{- message['content'] + '<|end_of_text|>' }}{% endgeneration %}{{- '\\n' }}\n"
        "     {%- else %}\n" + _GRANITE_TURN + "     {%- endif %}\n",
    ),
}


@dataclass(frozen=True)
class Family:
    kind: str
    """sentencepiece, llama3 or bytelevel: the tokenizer's kind."""
    specials: tuple[str, ...]
    config: dict
    """tokenizer_config.json's special tokens, as the family's folder has them."""
    end_of_turn: str | None = None
    """The token that ends an assistant turn, when it is not the eos_token."""


FAMILIES = {
    "llama2": Family("sentencepiece", ("<unk>", "<s>", "</s>"), {"bos_token": "<s>", "eos_token": "</s>"}),
    "llama3": Family(
        "llama3",
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    ),
    "openchat": Family(
        "sentencepiece",
        ("<unk>", "<s>", "</s>", "<|end_of_turn|>"),
        {"bos_token": "<s>", "eos_token": "<|end_of_turn|>"},
    ),
    "chatml": Family("bytelevel", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), {"eos_token": "<|im_end|>"}),
    "phi3": Family(
        "sentencepiece",
        ("<unk>", "<s>", "</s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
        {"bos_token": "<s>", "eos_token": "<|endoftext|>"},
        "<|end|>",
    ),
    "gemma2": Family(
        "gemma",
        ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
        {"bos_token": "<bos>", "eos_token": "<eos>"},
        "<end_of_turn>",
    ),
    "gemma3": Family(
        "gemma",
        ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>"),
        {"bos_token": "<bos>", "eos_token": "<eos>"},
        "<end_of_turn>",
    ),
    "phi4": Family(
        "llama3",
        ("<|endoftext|>", "<|im_start|>", "<|im_sep|>", "<|im_end|>"),
        {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"},
    ),
    # OLMo 2's role headers are plain text; its one special token begins and ends every turn.
    "olmo2": Family(
        "llama3", ("<|endoftext|>", "<|pad|>"), {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
    ),
    "granite3": Family(
        "bytelevel",
        ("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"),
        {"bos_token": "<|end_of_text|>", "eos_token": "<|end_of_text|>"},
    ),
    "last_turn_eos": Family(
        "bytelevel", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), {"eos_token": "<|endoftext|>"}
    ),
    "deepseek_r1": Family(
        "bytelevel",
        ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"),
        {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
    ),
}

UNTELLABLE = {
    "mistral_nemo": Family(
        "llama3", ("<unk>", "<s>", "</s>", "[INST]", "[/INST]"), {"bos_token": "<s>", "eos_token": "</s>"}
    )
}
"""Families whose shipped template the token-position rule cannot read (their templates: MISTRAL_NEMO)."""

# Llama 3's pre-tokenizer pattern (tiktoken's cl100k shape), as its tokenizer.json holds it.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def train_tokenizer(kind: str, texts: list[str], specials: tuple[str, ...], vocab_size: int = 600):
    """A ``tokenizers.Tokenizer`` of ``kind`` trained on ``texts``."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if kind in ("sentencepiece", "gemma"):
        # Trained on words marked by ▁, then saved as Llama 2's tokenizer.json has it: no pre-tokenizer, a
        # normalizer that prepends ▁ and turns spaces into ▁, byte fallback for what the vocabulary lacks.
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        byte_tokens = [f"<0x{value:02X}>" for value in range(256)]
        trainer = trainers.BpeTrainer(vocab_size=vocab_size + 256, special_tokens=[*specials, *byte_tokens])
        tokenizer.train_from_iterator(texts, trainer)
        tokenizer.pre_tokenizer = None
        # Gemma's SentencePiece adds no space at the start of a text (add_dummy_prefix false).
        prepend = [normalizers.Prepend("▁")] if kind == "sentencepiece" else []
        tokenizer.normalizer = normalizers.Sequence([*prepend, normalizers.Replace(" ", "▁")])
        strip = [decoders.Strip(" ", 1, 0)] if kind == "sentencepiece" else []
        tokenizer.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
        )
        # The byte tokens are the vocabulary's own, as in Llama 2's file, not added tokens.
        saved = json.loads(tokenizer.to_str())
        saved["added_tokens"] = [token for token in saved["added_tokens"] if token["content"] not in byte_tokens]
        return Tokenizer.from_str(json.dumps(saved))
    tokenizer = Tokenizer(models.BPE())
    if kind == "llama3":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(specials), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def make_family_folder(folder: Path, family: str, texts: list[str], *, marked: bool = False) -> Path:
    """A tokenizer folder of ``family``'s kind with its shipped (or marked) chat template."""
    spec = {**FAMILIES, **UNTELLABLE}[family]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    train_tokenizer(spec.kind, texts, spec.specials).save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        **spec.config,
        "chat_template": (MARKED if marked else SHIPPED).get(family, MISTRAL_NEMO_MARKED if marked else MISTRAL_NEMO),
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    return folder

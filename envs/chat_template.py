"""The ChatML chat template with tools (the Qwen2.5/Hermes convention) that pacerl's tokenizers carry.

Tool schemas go into the system turn inside <tools></tools>; the assistant calls tools with
<tool_call>{"name": ..., "arguments": ...}</tool_call>; each tool response is wrapped in
<tool_response></tool_response>, and consecutive responses share one user turn. Env observations
(`{"role": "tool", "content": ...}`) and `ToolEnv.tool_schemas()` render with it through any Hugging
Face tokenizer: `tokenizer.apply_chat_template(messages, tools=env.tool_schemas())`.
"""

CHATML_TOOLS_TEMPLATE = r"""
{%- if messages and messages[0].role == 'system' %}
    {%- set system = messages[0].content %}
    {%- set rest = messages[1:] %}
{%- else %}
    {%- set system = '' %}
    {%- set rest = messages %}
{%- endif %}
{%- if system or tools %}
    {{- '<|im_start|>system\n' + system }}
    {%- if tools %}
        {%- if system %}{{- '\n\n' }}{%- endif %}
        {{- '# Tools\n\nYou may call one or more functions. ' }}
        {{- 'Their signatures are within <tools></tools>:\n<tools>' }}
        {%- for tool in tools %}
            {{- '\n' + (tool | tojson) }}
        {%- endfor %}
        {{- '\n</tools>\n\nFor each call, answer with a JSON object within <tool_call></tool_call> tags:\n' }}
        {{- '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' }}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- endif %}
{%- for message in rest %}
    {%- if message.role == 'tool' %}
        {%- if loop.first or rest[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or rest[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

#!/usr/bin/env python3
"""Longest functions in C++ files: lines from the signature to the closing
brace (comments and strings blanked; a lambda counts in its function).
Usage: scripts/function_lengths.py src/*/*.cpp  (TOP=n rows, default 15)."""
import re, sys
def strip(src):
    out=[]; i=0; n=len(src)
    while i<n:
        c=src[i]
        if src.startswith('//',i):
            j=src.find('\n',i); j=n if j<0 else j; out.append(' '*(j-i)); i=j
        elif src.startswith('/*',i):
            j=src.find('*/',i)+2; out.append(re.sub(r'[^\n]',' ',src[i:j])); i=j
        elif c=='"' and src[i-1:i]!="'" :
            if src[i-1:i]=='R':
                m=re.match(r'R"([^(]*)\(',src[i-1:]); end=')'+m.group(1)+'"'; j=src.find(end,i)+len(end)
            else:
                j=i+1
                while src[j]!='"': j+= 2 if src[j]=='\\' else 1
                j+=1
            out.append(re.sub(r'[^\n]',' ',src[i:j])); i=j
        elif c=="'":
            j=i+1
            while src[j]!="'": j+= 2 if src[j]=='\\' else 1
            out.append(' '*(j+1-i)); i=j+1
        else: out.append(c); i+=1
    return ''.join(out)
res=[]
for f in sys.argv[1:]:
    s=strip(open(f).read())
    stack=[]  # (kind, start_line, name)
    last=0
    for m in re.finditer(r'[{};]',s):
        ch=m.group(); pos=m.start()
        if ch=='{':
            head=s[last:pos]
            inside_fn=any(k=='fn' for k,_,_ in stack)
            h=head.strip()
            kind='blk'
            if not inside_fn and re.search(r'\)\s*(const|override|final|noexcept|mutable|\s|->\s*[\w:<>,\s*&]+)*$',h) or (not inside_fn and re.search(r'\)\s*:\s*[\s\S]*\)$',h) and ')' in h):
                if not re.match(r'^(if|for|while|switch|catch)\b',h.split('\n')[-1].strip()):
                    kind='fn'
            name=re.sub(r'\s+',' ',h.split('(')[0].split('\n')[-1]).strip()[-60:]
            line=s.count('\n',0,pos)+1
            # start line: first line of head
            hl=line - h.count('\n') if kind=='fn' else line
            stack.append((kind,hl,name))
            last=pos+1
        elif ch=='}':
            if stack:
                kind,hl,name=stack.pop()
                if kind=='fn':
                    end=s.count('\n',0,pos)+1
                    res.append((end-hl+1,f,hl,name))
            last=pos+1
        else:
            last=pos+1
res.sort(reverse=True)
for n,f,l,name in res[:int(__import__('os').environ.get('TOP','15'))]:
    print(f'{n:5d}  {f}:{l}  {name}')

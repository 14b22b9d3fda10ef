/* The try-it page served at GET / (with /page.js and /page.css): pick an image, .npy, CSV or JSON file
 * (or paste JSON/CSV) and see the answer drawn: a detector's boxes and labels on the image (a canvas)
 * with a table of the detections, a classifier's top-k as labelled bars, other models' tensors as JSON.
 *
 * Self-contained and small: no external scripts, fonts or images. The script and the style are served
 * as their own paths, not inline, so the page runs under a strict Content-Security-Policy (EP_PAGE_CSP:
 * nothing but this origin's script, style and fetches; uploaded images are decoded with
 * createImageBitmap, so no img-src at all). Labels and everything else from the model are outside
 * input: the script writes them with textContent and canvas fillText only, never as HTML. The picture
 * is drawn as stored (EXIF orientation ignored), as the artifact's decoder sees it, so boxes land where
 * the model found them; an answer that arrives after a newer upload is dropped. */
#include "ep_page.h"

#include <string.h>

const char ep_page_html[] =
    "<!doctype html><html lang=en><head><meta charset=utf-8><title>edgepack</title>"
    "<meta name=viewport content='width=device-width,initial-scale=1'>"
    "<link rel=stylesheet href=/page.css><script src=/page.js defer></script></head><body><main>"
    "<h1 id=title>edgepack model</h1><p id=io></p>"
    "<p><label>File (image, .npy, .csv, .json): <input type=file id=file></label></p>"
    "<p><label for=text>or paste JSON / CSV:</label><br>"
    "<textarea id=text placeholder='[[0.1, 0.2]] or 1.0,2.0'></textarea><br><button id=send type=button>Predict</button></p>"
    "<p id=status role=status aria-live=polite></p>"
    "<canvas id=canvas role=img aria-label='the uploaded image' hidden></canvas>"
    "<ol id=top aria-label='top classes'></ol>"
    "<div class=tw><table id=dets hidden><caption id=dcap></caption><thead><tr><th scope=col>#<th scope=col>label"
    "<th scope=col>score<th scope=col>box (x1, y1, x2, y2)</thead><tbody id=dbody></tbody></table></div>"
    "<details id=raw open><summary>Answer (JSON)</summary><pre id=result></pre></details>"
    "</main></body></html>"
    "\n";

static const char page_css[] =
    "[hidden]{display:none!important}"
    "body{font:15px/1.4 system-ui,sans-serif;max-width:52em;margin:1em auto;padding:0 1em;color:#111}"
    "h1{font-size:1.4em;overflow-wrap:anywhere}"
    "textarea{width:100%;height:5em;box-sizing:border-box}"
    "button,input,textarea{font:inherit}"
    "button{padding:.3em 1.2em;margin-top:.3em}"
    ":focus-visible{outline:3px solid #1f6fb2;outline-offset:2px}"
    "canvas{display:block;max-width:100%;height:auto;margin:.5em 0;border:1px solid #bbb}"
    "#top{padding:0;list-style:none}"
    "#top li{display:grid;grid-template-columns:minmax(3em,12em) 1fr 4em;gap:.6em;align-items:center;margin:.3em 0}"
    ".lab{overflow-wrap:anywhere}"
    ".track{background:#e4e4e4;height:1.1em;border-radius:2px}"
    ".bar{display:block;height:100%;background:#1f6fb2;border-radius:2px}"
    ".num{text-align:right;font-variant-numeric:tabular-nums}"
    ".tw{overflow-x:auto}"
    "table{border-collapse:collapse;margin:.5em 0}"
    "caption{text-align:left;font-weight:600}"
    "td,th{padding:.2em .6em;border-bottom:1px solid #ddd;text-align:left;font-variant-numeric:tabular-nums}"
    ".sw{display:inline-block;width:.9em;height:.9em;margin-right:.4em;vertical-align:-.1em}"
    "pre{background:#f4f4f4;padding:1em;overflow:auto;max-height:30em}"
    "\n";

static const char page_js[] =
    "'use strict';\n"
    "const $=id=>document.getElementById(id);\n"
    "const PAL=['#c62828','#1565c0','#2e7d32','#6a1b9a','#ad5a00','#00695c','#ad1457','#4e342e','#37474f','#5d6b00'];\n"
    "function el(tag,text,cls){const e=document.createElement(tag);if(text!=null)e.textContent=String(text);if(cls)e.className=cls;return e}\n"
    "function num(v,d){return typeof v==='number'&&isFinite(v)?v.toFixed(d):'\\u2014'}\n"
    "function colour(i){return PAL[(Number.isInteger(i)&&i>=0?i:0)%PAL.length]}\n"
    "function say(t){$('status').textContent=t}\n"
    "fetch('/info').then(r=>r.json()).then(m=>{\n"
    "const pp=m.prepost||{},post=pp.postprocess||{};\n"
    "const kind=post.detect?'detector':Object.keys(post).length?'classifier':'tensors';\n"
    "document.body.dataset.kind=kind;\n"
    "$('title').textContent=m.model.name+' ('+m.target.name+', '+m.backend.name+')';\n"
    "$('io').textContent='inputs: '+m.inputs.map(i=>i.name+' '+i.shape.join('x')+' '+i.dtype).join(', ')+(pp.preprocess?' \\u2014 takes images':'')+' \\u2014 '+kind;\n"
    "}).catch(e=>say('cannot read /info: '+e));\n"
    "function clear(){delete $('canvas').dataset.boxes;$('top').replaceChildren();$('dbody').replaceChildren();$('dets').hidden=true;$('canvas').hidden=true;$('result').textContent=''}\n"
    "function bars(top){\n"
    "const hi=Math.max(1,...top.map(t=>Math.abs(Number(t.score))||0));\n"
    "top.forEach(t=>{const li=el('li'),tr=el('span',null,'track'),b=el('span',null,'bar'),s=Number(t.score)||0;\n"
    "li.dataset.score=s;tr.setAttribute('aria-hidden','true');b.style.width=Math.max(0,s)/hi*100+'%';tr.append(b);\n"
    "li.append(el('span',t.label,'lab'),tr,el('span',num(t.score,3),'num'));$('top').append(li)})}\n"
    "function okBox(o){return o&&Array.isArray(o.box)&&o.box.length===4&&o.box.every(Number.isFinite)}\n"
    /* draw: the picture, then each box outlined in its class colour with "label score" on a filled tab
     * above it (inside when at the top edge); line and text scale with the picture. */
    "function draw(pic,d){\n"
    "const c=$('canvas'),x=c.getContext('2d'),big=Math.max(pic.width,pic.height);\n"
    "c.width=pic.width;c.height=pic.height;x.drawImage(pic,0,0);\n"
    "const lw=Math.max(2,Math.round(big/250)),fs=Math.max(12,Math.round(big/40));\n"
    "x.lineWidth=lw;x.font=fs+'px system-ui,sans-serif';x.textBaseline='top';\n"
    "let n=0;\n"
    "d.filter(okBox).forEach(o=>{const[x1,y1,x2,y2]=o.box,col=colour(o.index),t=o.label+' '+num(o.score,2);\n"
    "x.strokeStyle=col;x.strokeRect(x1,y1,x2-x1,y2-y1);\n"
    "const w=x.measureText(t).width+2*lw,h=fs+2*lw,ty=y1-lw/2-h>=0?y1-lw/2-h:y1+lw/2;\n"
    "x.fillStyle=col;x.fillRect(x1-lw/2,ty,w,h);x.fillStyle='#fff';x.fillText(t,x1-lw/2+lw,ty+lw);n++});\n"
    "c.dataset.boxes=n;\n"
    "c.setAttribute('aria-label',d.length?d.length+' detections: '+d.map(o=>o.label+' '+num(o.score,2)).join(', '):'the uploaded image');\n"
    "c.hidden=false}\n"
    "function table(d){\n"
    "d.forEach((o,i)=>{const r=el('tr'),l=el('td'),s=el('span',null,'sw'),col=colour(o.index);\n"
    "r.dataset.colour=col;s.style.background=col;s.setAttribute('aria-hidden','true');l.append(s,el('span',o.label));\n"
    "r.append(el('td',i+1),l,el('td',num(o.score,3)),el('td',okBox(o)?o.box.map(v=>num(v,0)).join(', '):'\\u2014'));$('dbody').append(r)});\n"
    "$('dcap').textContent=d.length?d.length+' detection'+(d.length>1?'s':''):'no detections above the threshold';\n"
    "$('dets').hidden=false}\n"
    "function show(j,pic){\n"
    "$('result').textContent=JSON.stringify(j,null,1);\n"
    "const d=Array.isArray(j.detections)?j.detections:null,top=Array.isArray(j.top)?j.top:null;\n"
    "$('raw').open=!(d||top);\n"
    "if(pic)draw(pic,d||[]);\n"
    "if(d)table(d);\n"
    "if(top)bars(top)}\n"
    /* stored(f): a JPEG copy whose EXIF Orientation (tag 0x0112, IFD0 of the APP1 Exif segment) is 1, or f
     * itself; markers are walked up to SOS and every read stays inside its segment. */
    "function stored(f){return f.arrayBuffer().then(a=>{const v=new DataView(a),L=a.byteLength;\n"
    "if(L<4||v.getUint16(0)!==0xFFD8)return f;\n"
    "for(let p=2;p+4<=L;){const m=v.getUint16(p),n=v.getUint16(p+2),e=p+2+n;\n"
    "if(m<0xFFC0||m===0xFFDA||n<2||e>L)break;\n"
    "if(m===0xFFE1&&n>=16&&v.getUint32(p+4)===0x45786966){const t=p+10,le=v.getUint16(t)===0x4949,i=t+v.getUint32(t+4,le);\n"
    "for(let j=0,q=i+2;i+2<=e&&j<v.getUint16(i,le)&&q+12<=e;j++,q+=12)\n"
    "if(v.getUint16(q,le)===0x0112){v.setUint16(q+8,1,le);return new Blob([a],{type:f.type})}}\n"
    "p=e}\n"
    "return f})}\n"
    /* post: the request and the picture's decoding in parallel; only the latest upload's answer is shown. */
    "let seq=0;\n"
    "function post(body,type,pic){\n"
    "const my=++seq;say('running\\u2026');clear();\n"
    "Promise.all([fetch('/predict',{method:'POST',headers:{'Content-Type':type},body:body}).then(r=>r.json().then(j=>[r.status,j])),pic])\n"
    ".then(([[s,j],p])=>{if(my!==seq)return;show(j,p);say('HTTP '+s)}).catch(e=>{if(my===seq)say(String(e))})}\n"
    "$('file').onchange=()=>{const f=$('file').files[0];if(!f)return;let t=f.type;const n=f.name.toLowerCase();\n"
    "if(n.endsWith('.npy'))t='application/x-npy';else if(n.endsWith('.csv'))t='text/csv';\n"
    "else if(n.endsWith('.json'))t='application/json';else if(n.endsWith('.ppm')||n.endsWith('.pgm'))t='image/x-portable-anymap';\n"
    "else if(!t)t='application/octet-stream';\n"
    "const pic=/^image\\/(png|jpeg|gif|webp|bmp)$/.test(t)&&window.createImageBitmap?stored(f).catch(()=>f).then(b=>createImageBitmap(b)).catch(()=>null):Promise.resolve(null);\n"
    "post(f,t,pic)};\n"
    "$('send').onclick=()=>{const v=$('text').value.trim();post(v,/^[\\[{]/.test(v)?'application/json':'text/csv',Promise.resolve(null))};\n";

static const ep_page_asset assets[] = {
    {"/", "text/html; charset=utf-8", ep_page_html, sizeof ep_page_html - 1},
    {"/page.js", "text/javascript; charset=utf-8", page_js, sizeof page_js - 1},
    {"/page.css", "text/css; charset=utf-8", page_css, sizeof page_css - 1},
};

const ep_page_asset *ep_page_find(const char *path) {
    for (size_t i = 0; i < sizeof assets / sizeof assets[0]; i++)
        if (strcmp(path, assets[i].path) == 0) return &assets[i];
    return NULL;
}
